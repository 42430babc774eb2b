"""The module each rank of a torchrun group runs (``scores.launcher: torchrun``):
``python -m torch.distributed.run <options> -m tasks.jobs.rank_main PAYLOAD``, PAYLOAD being the file that
:func:`covgrad.distributed.launch.launch_ranks` wrote (for the scores stage: ``tasks.jobs.scores_ranks``' per-rank
body and the job's arguments). The rank's exception is recorded by :func:`covgrad.distributed.launch.torchrun_rank`
(written under a temporary name and renamed) and its traceback goes to stderr. torchrun's own ``record`` is not
used: it writes ``TORCHELASTIC_ERROR_FILE`` in place, and torchrun, reading a file that is still being written after
a peer was killed, fails with a JSONDecodeError instead of its failure summary."""

import sys

from covgrad.distributed import torchrun_rank

if __name__ == "__main__":
    torchrun_rank(sys.argv[1])
