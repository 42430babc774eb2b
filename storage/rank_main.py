"""The module each rank of a torchrun group runs (``scores.launcher: torchrun``):
``python -m torch.distributed.run <options> -m storage.rank_main PAYLOAD``, PAYLOAD being the file that
:func:`covgrad.fsdp.launch_torchrun` wrote (for the scores stage: ``storage.scores_ranks``' per-rank body and
the job's arguments). ``record`` writes the rank's exception into torchrun's error file
(``TORCHELASTIC_ERROR_FILE``), so torchrun's failure summary shows its traceback."""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from covgrad.fsdp import torchrun_rank

if __name__ == "__main__":
    record(torchrun_rank)(sys.argv[1])
