"""The offline environment: the settings every covgrad process runs under on a machine without internet.

One home for them on the Python side: ``covgrad run`` (``flows.cli``), the tests' conftest and the benchmarks call
:func:`offline_env` before Hugging Face or Prefect is imported (both read these variables once, at import).
The shell side (the Prefect server, worker and deploy scripts) sources ``scripts/env.sh``, which exports the
same offline values. This module imports nothing but ``os``, so calling it first costs nothing.
"""

import os

OFFLINE_ENV: dict[str, str] = {
    # no network: the Hugging Face hub and transformers read local files only
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # no telemetry: Prefect's server analytics, UI and resource metrics, and every tool that honours DO_NOT_TRACK
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_UI_ENABLED": "false",
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
    # quiet: no tokenizer thread pools across forks, no download or "Loading weights" progress bars
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # the temporary server `covgrad run` starts without PREFECT_API_URL needs far more than the default 20 s on a
    # loaded machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
}
"""Variable → value of the offline environment; a value already set in the environment wins."""


def offline_env() -> None:
    """Set every variable of :data:`OFFLINE_ENV` that the environment does not set yet (``os.environ.setdefault``);
    returns nothing. Call it before ``transformers``, ``huggingface_hub`` or ``prefect`` is imported."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
