"""SmolLM2 sweep, mismatch columns only: the offpolicy stage's computation (tasks.offpolicy.policy_logp_of +
covgrad.mismatch.mismatch_metrics) on the completed rollouts of the policy, its fp32 and its bf16 copy."""

import time

from covgrad.mismatch import mismatch_metrics
from storage.artifacts import ArtifactStore
from storage.models import load_model
from tasks.offpolicy import MISMATCH_COLUMNS, policy_logp_of

store = ArtifactStore("/work/tmp/identity-smol")
policy = load_model("/work/models/smollm2-135m-instruct", "float32")
for name, key in (
    ("policy", "144b5ba5a6c5e0a67a6f245d"),
    ("fp32", "44dcfeff1fdb63fdc143a7bc"),
    ("bf16", "de7d42802523d5f071731408"),
):
    ref = store.ref("rollouts", key)
    assert store.is_complete(ref), name
    t = time.perf_counter()
    m = mismatch_metrics(*policy_logp_of(store, ref, policy))
    row = {c: m[k] for c, k in MISMATCH_COLUMNS.items()}
    print(name, {k: f"{v:.3g}" for k, v in row.items()}, f"{time.perf_counter() - t:.0f} s", flush=True)
