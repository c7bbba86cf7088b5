"""The bar chart of `triforce bench offload`: ms/token per method, with the link measured in the same run."""
from __future__ import annotations


def write_plot(rows: list[dict], h2d_gbps: float, title: str, path: str) -> bool:
    """Bar chart of ms/token; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    good = [r for r in rows if "ms_per_token" in r]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar([r["method"] for r in good], [r["ms_per_token"] for r in good],
                  color=["#888888", "#bb8844", "#3366aa"][:len(good)])
    for bar, r in zip(bars, good):
        ax.annotate(f"{r['ms_per_token']:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("ms per token")
    ax.set_title(f"{title}\nhost-to-device copy {h2d_gbps:.1f} GB/s measured in the same run", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
