"""False-alarm rate and power of the report's zero-mean test on the demo's own samples.

The demo's policy is trained as the base_model stage trains it (``configs/demo.yaml``: the tiny Llama, SFT on
2-digit addition until its sampled accuracy lies in ``model.demo.target_accuracy``; the last checkpoint at or below
``stale_max_accuracy`` is kept as the stale sampler). Each data set is then what the demo's scores stage would see
with fresh sampling seeds: the task's 32 prompts, 8 responses each of at most 4 tokens drawn by
``covgrad.rollouts.sampling.generate``, and the exact per-sample scores ∇θ log p(response) of every parameter
(``PerSampleGrads``, policy centering). Of each data set the report's two statistics are computed by the library
(``compute_stats`` of ``sample_moments``: ``zero_mean_trace``, ``zero_mean_coord``) and judged as the report judges
them (``group_bootstrap``'s one-sided cross-fit test between the even and the odd prompt groups: above the 95% band
exactly when z > 1.645).

- on-policy: the policy's own samples, where E[s | prompt] = 0 holds; a statistic outside its band is a false
  alarm (``--runs`` data sets, sampling seeds ``--seed`` + 1, 2, ...); the table also gives the mean and standard
  deviation of z over them (0 and 1 for a calibrated test).
- centring errors, each scored as if on-policy (∇ log p of the policy at temperature 1), ``--power-runs`` data
  sets each: samples drawn at temperature 0.8, with nucleus truncation top_p = 0.9, or by the stale checkpoint;
  and the on-policy scores plus a constant offset k·σ_i (σ_i: the coordinate's standard deviation in the data
  set), k = 0.05 and 0.1. A statistic outside its band is a detection.

Prints a markdown table with the command and the machine.

    OMP_NUM_THREADS=1 python -m benchmarks.zero_mean                        # 200 + 5 x 16 data sets
    OMP_NUM_THREADS=1 python -m benchmarks.zero_mean --runs 20 --power-runs 4   # a quick look
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from covgrad.offline import OFFLINE_ENV

os.environ.update({**OFFLINE_ENV, **os.environ})  # the offline environment (unset values) before transformers loads

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from covgrad.config import PipelineConfig, read_config_file
from covgrad.layout import select_parameters
from covgrad.models import build_demo_model
from covgrad.moments.quantiles import Z95
from covgrad.moments.stats import compute_stats, sample_moments
from covgrad.report.uncertainty import group_bootstrap
from covgrad.rollouts import addition_problems, answer_tokens, build_char_tokenizer
from covgrad.rollouts.batch import RolloutBatch
from covgrad.rollouts.sampling import SamplerSpec, generate
from covgrad.scores import PerSampleGrads
from covgrad.scores.centering import policy_logit_grad
from covgrad.updates import train_sft
from storage.stores.prompts import load_problems

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
STATS = ("trace", "coord")


@dataclass(frozen=True)
class Scenario:
    """A kind of data set: who samples and how, and an offset added to the scores (in σ_i units)."""

    name: str
    sampler: str  # "policy" or "stale"
    spec: SamplerSpec
    offset: float = 0.0


def train_demo(cfg: PipelineConfig) -> dict[str, dict[str, torch.Tensor]]:
    """The policy's and the stale checkpoint's weights, trained as the base_model stage trains them."""
    demo, digits = cfg.model.demo, cfg.task.digits
    torch.manual_seed(demo.seed)
    tokenizer = build_char_tokenizer()
    model = build_demo_model(demo, tokenizer)
    eval_problems = addition_problems(demo.eval_prompts, digits, seed=demo.seed + 1_000_003)

    def train_problems(step: int) -> list:
        return addition_problems(demo.batch_size, digits, seed=zlib.crc32(f"{demo.seed}:{step}".encode()))

    result = train_sft(model, tokenizer, demo, train_problems, eval_problems, answer_tokens(digits))
    print(
        f"demo SFT: {result.steps} steps, policy accuracy {result.policy_accuracy:.3f}, stale (step "
        f"{result.stale_step}) {result.stale_accuracy:.3f}",
        flush=True,
    )
    return {"policy": result.policy_state, "stale": result.stale_state}


class DataSets:
    """Fresh data sets of the demo: (N, P) float32 score rows and (N,) prompt groups."""

    def __init__(self, cfg: PipelineConfig, states: dict[str, dict[str, torch.Tensor]]) -> None:
        self.tokenizer: PreTrainedTokenizerFast = build_char_tokenizer()
        self.models: dict[str, PreTrainedModel] = {}
        for name, state in states.items():
            model = build_demo_model(cfg.model.demo, self.tokenizer)
            model.load_state_dict(state)
            self.models[name] = model.eval()
        self.policy = self.models["policy"]
        self.layout = select_parameters(self.policy)
        self.psg = PerSampleGrads(self.policy, self.layout, check=False)
        sampler = cfg.rollouts.samplers[cfg.rollouts.analyse]
        self.group_size, self.T = sampler.group_size, sampler.max_new_tokens
        self.prompts = [self.tokenizer(p.prompt)["input_ids"] for p in load_problems(cfg.task)]

    def scores(self, scenario: Scenario, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """The policy-centred scores of ``scenario``'s responses drawn with sampling seed ``seed``, plus its offset."""
        out = generate(
            self.models[scenario.sampler],
            self.prompts,
            list(range(len(self.prompts))),
            self.group_size,
            scenario.spec,
            seed,
            batch_size=len(self.prompts) * self.group_size,
            eos_id=self.tokenizer.eos_token_id,
            pad_id=self.tokenizer.pad_token_id,
        )
        group = out["prompt_index"].numpy()
        N = group.size
        arrays = (out[k].numpy() for k in ("tokens", "prompt_len", "response_len", "response_mask"))
        batch = RolloutBatch.from_arrays(*arrays, np.zeros(N), group, trim=True)
        dlogits = policy_logit_grad(batch, torch.device("cpu"))
        S = self.psg(batch.input_ids, batch.attention_mask, dlogits, batch.position_ids).numpy()
        if scenario.offset:
            S = (S + scenario.offset * S.astype(np.float64).std(axis=0)).astype(np.float32)
        return S, group


def judge(S: np.ndarray, group: np.ndarray) -> dict[str, float]:
    """Each statistic, its band's ends, its z and the verdict (1 above the band, 0 inside), as the report makes
    them."""
    N, P = S.shape
    stats = compute_stats(sample_moments(S, np.zeros(N)))
    tests = group_bootstrap(lambda a, b: S[:, a:b], np.zeros(N), group, P, [], n_boot=0)["zero_mean"]
    assert tests is not None, "the demo has even and odd prompt groups"
    out: dict[str, float] = {}
    for k in STATS:
        value, test = float(stats[f"zero_mean_{k}"]), tests[k]
        out |= {k: value, f"{k}_lo": test.band[0], f"{k}_hi": test.band[1], f"{k}_z": test.z}
        out[f"{k}_side"] = float(test.z > Z95)
    return out


def run(data: DataSets, scenario: Scenario, seeds: range, log: Callable[[str], None]) -> list[dict[str, float]]:
    """``judge`` of each data set of ``scenario`` at ``seeds``."""
    rows = []
    for seed in seeds:
        t0 = time.perf_counter()
        rows.append(judge(*data.scores(scenario, seed)))
        r = rows[-1]
        words = ", ".join(
            f"{k} {r[k]:.3f} [{r[f'{k}_lo']:.3f}, {r[f'{k}_hi']:.3f}] z {r[f'{k}_z']:+.2f}" for k in STATS
        )
        log(f"{scenario.name} seed {seed}: {words} ({time.perf_counter() - t0:.1f} s)")
    return rows


def table_row(scenario: Scenario, rows: list[dict[str, float]]) -> str:
    """One markdown row: data sets, then per statistic the share above its band, z's mean and standard deviation,
    and the statistic's mean with its band's mean upper end."""
    cells = [scenario.name, str(len(rows))]
    for k in STATS:
        cells.append(f"{np.mean([r[f'{k}_side'] for r in rows]):.1%}")
    for k in STATS:
        z = np.array([r[f"{k}_z"] for r in rows])
        cells.append(f"{z.mean():+.2f} / {z.std():.2f}")
    for k in STATS:
        cells.append(f"{np.mean([r[k] for r in rows]):.3g} [{np.mean([r[f'{k}_hi'] for r in rows]):.3g}]")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="on-policy data sets (false-alarm rate)")
    parser.add_argument("--power-runs", type=int, default=16, help="data sets of each centring error")
    parser.add_argument("--seed", type=int, default=0, help="the data sets' sampling seeds are seed + 1, 2, ...")
    parser.add_argument("--weights", type=Path, help="cache of the trained demo weights (torch.save), made if absent")
    parser.add_argument("--quiet", action="store_true", help="no line per data set")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = PipelineConfig.model_validate(read_config_file(CONFIG))
    if args.weights is not None and args.weights.exists():
        states = torch.load(args.weights)
    else:
        states = train_demo(cfg)
        if args.weights is not None:
            torch.save(states, args.weights)
    data = DataSets(cfg, states)
    T = data.T
    scenarios = [
        Scenario("on-policy (E[s] = 0)", "policy", SamplerSpec(max_new_tokens=T)),
        Scenario("temperature 0.8", "policy", SamplerSpec(temperature=0.8, max_new_tokens=T)),
        Scenario("top_p 0.9", "policy", SamplerSpec(top_p=0.9, max_new_tokens=T)),
        Scenario("stale checkpoint", "stale", SamplerSpec(max_new_tokens=T)),
        Scenario("offset 0.05·σ", "policy", SamplerSpec(max_new_tokens=T), offset=0.05),
        Scenario("offset 0.1·σ", "policy", SamplerSpec(max_new_tokens=T), offset=0.1),
    ]
    log = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    results = []
    for i, scenario in enumerate(scenarios):
        n = args.runs if i == 0 else args.power_runs
        start = args.seed + 1 + (0 if i == 0 else args.runs + (i - 1) * args.power_runs)
        results.append((scenario, run(data, scenario, range(start, start + n), log)))
    wall = time.perf_counter() - t_start
    cpu = platform.processor() or platform.machine()
    command = ["python", "-m", "benchmarks.zero_mean", *(sys.argv[1:] if argv is None else argv)]
    print(f"\nCommand: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} {' '.join(command)}`")
    print(f"Machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}; {wall / 60:.1f} min wall")
    print(f"N = {len(data.prompts) * data.group_size} responses in {len(data.prompts)} prompt groups, P = "
          f"{data.layout.P:,} parameters; one-sided 95% bands of the cross-fit test\n")  # fmt: skip
    print("| data sets | runs | zero_mean_trace above its band | zero_mean_coord above its band | z trace mean / sd "
          "| z coord mean / sd | mean trace [mean band top] | mean coord [mean band top] |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for scenario, rows in results:
        if rows:
            print(table_row(scenario, rows))


if __name__ == "__main__":
    main()
