"""A real TRL ``GRPOTrainer`` on the processes ``torchrun`` starts (DDP on CPU, gloo), each attaching a
``CovgradInRun``: ``python -m torch.distributed.run --nproc-per-node 2 --standalone -m tests.helpers.trl_ranks OUT``.

``OUT/model`` holds the tiny checkpoint the run starts from (written by the caller). Each process saves, per
training generation, the rows it folds (``rows-{step}-{rank}.pt``: ids, attention mask, loss mask, advantages and
global prompt groups, as ``CovgradInRun`` forms them); rank 0 saves the weights before the first step
(``step0``); the in-run files go to ``OUT/inrun``."""

from __future__ import annotations

import sys
from pathlib import Path

from covgrad.offline import offline_env

offline_env()

G = 4  # completions per prompt; each process takes one prompt group per step


def varied(prompts: list, completions: list[str], **kwargs: object) -> list[float]:
    """A reward that varies within a group of a random model's completions: their characters' codes mod 5."""
    return [float(sum(map(ord, c)) % 5) for c in completions]


def main(out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from covgrad.integrations.trl import CovgradInRun, _rows
    from covgrad.rollouts.problems import addition_problems
    from tests.helpers.trainers import cpu_grpo_args

    torch.set_num_threads(1)
    data = Dataset.from_list([{"prompt": p.prompt} for p in addition_problems(8, 2, seed=0)])
    args = cpu_grpo_args(out / "trl", G, G)
    model = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    inrun = CovgradInRun(out / "inrun", every_n=1)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=varied,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(out / "model"),
        callbacks=[inrun],
    )
    rank = trainer.accelerator.process_index
    assert trainer.accelerator.num_processes == 2
    if rank == 0:
        model.save_pretrained(out / "step0")
    generate = trainer._generate_and_score_completions

    def recorded(inputs: object) -> dict:
        result = generate(inputs)
        ids, mask, loss = _rows(result)
        group = (rank * ids.shape[0] + torch.arange(ids.shape[0])) // G
        rows = {"ids": ids, "mask": mask, "loss": loss, "advantages": result["advantages"], "group": group}
        torch.save(rows, out / f"rows-{trainer.state.global_step}-{rank}.pt")
        return result

    trainer._generate_and_score_completions = recorded  # below the callback's wrapper: the rows it folds
    inrun.attach(trainer)
    trainer.train()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
