"""One row of line plots, layer time against token count per system: the benchmark pages' plots
(used by render_bench_docs.py and render_decode_docs.py)."""

from pathlib import Path


def plot_panels(panels: dict[str, dict[int, dict[str, float]]], systems: tuple[str, ...],
                path: Path) -> None:
    """`panels`: {title: {tokens: {system: us}}}; one panel per title, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (title, by_tokens) in zip(axes, panels.items(), strict=True):
        tokens = sorted(by_tokens)
        for system in systems:
            ax.plot(tokens, [by_tokens[t][system] for t in tokens], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.set_ylabel("layer time (us)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
