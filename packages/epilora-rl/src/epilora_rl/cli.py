"""`epilora-rl train --config run.toml`: a GRPO run, resumed from its out_dir when one is there.

Prints a progress bar over steps (reward, accuracy, mismatch), held-out accuracy before and
after, and a summary table; writes out_dir/steps.jsonl, the adapter of every step in PEFT's
format, and TensorBoard events where tensorboard is installed.
"""

import argparse
import math
import sys


def summary_table(records: list[dict], evals: dict) -> str:
    columns = [("step", "{}"), ("reward", "{:.3f}"), ("accuracy", "{:.3f}"),
               ("kl_per_token", "{:.2e}"), ("tokens", "{}"), ("generate_s", "{:.1f}"),
               ("train_s", "{:.1f}")]
    lines = [" ".join(f"{name:>12}" for name, _ in columns)]
    for r in records:
        lines.append(" ".join(f"{fmt.format(r[name]):>12}" for name, fmt in columns))
    for name, value in evals.items():
        lines.append(f"held-out accuracy {name}: {value:.3f}")
    return "\n".join(lines)


def _writer(out_dir, records: list[dict]):
    """TensorBoard's writer, holding every finished step's record (None without tensorboard).
    A resumed run purges what an earlier process wrote and writes the records again, so the
    events equal steps.jsonl whenever the earlier process was killed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=1 if records else None)
    for record in records:
        _log(writer, record)
    return writer


def _log(writer, record: dict) -> None:
    for key, value in record.items():
        if isinstance(value, float) and not math.isnan(value):
            writer.add_scalar(key, value, record["step"])
    writer.flush()


def train(config_path: str) -> int:
    from tqdm import tqdm

    from epilora_rl.config import load_config

    try:
        config = load_config(config_path)
    except ValueError as e:  # before any model is loaded
        print(f"epilora-rl: {config_path}: {e}", file=sys.stderr)
        return 2
    from epilora_rl.trainer import GrpoRun, OutDirHoldsAnotherRun

    try:
        run = GrpoRun(config)
    except OutDirHoldsAnotherRun as e:
        print(f"epilora-rl: {e}", file=sys.stderr)
        return 2
    if run.step:
        print(f"resuming {config.run.out_dir} after step {run.step}")
    if "before" not in run.evals:
        run.evaluate("before")
    writer = _writer(run.out_dir, run.records)
    bar = tqdm(total=config.run.steps, initial=run.step, desc="GRPO", unit="step")
    while run.step < config.run.steps:
        record = run.train_step()
        bar.update(1)
        bar.set_postfix(reward=f"{record['reward']:.3f}", acc=f"{record['accuracy']:.2f}",
                        kl=f"{record['kl_per_token']:.1e}")
        if writer is not None:
            _log(writer, record)
    bar.close()
    if writer is not None:
        writer.close()
    run.evaluate("after")
    print(summary_table(run.records, run.evals))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epilora-rl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser = sub.add_parser("train", help="run (or resume) GRPO training")
    train_parser.add_argument("--config", required=True, help="the run's TOML file")
    args = parser.parse_args(argv)
    return train(args.config)


if __name__ == "__main__":
    sys.exit(main())
