"""Report writing that the benchmarks share: words for counts and for the machine's load, and
matplotlib figures (headless, saved and closed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plural(count: int, word: str, suffix: str = "s") -> str:
    """``count`` and ``word``, with ``suffix`` unless ``count`` is 1: "1 round", "3 rounds"."""
    return f"{count} {word}{'' if count == 1 else suffix}"


def lead_in_words(settings: dict[str, Any]) -> str:
    """How a short step was timed (``settings["lead_in_s"]``, harness's ``Group.lead_in_s``), as
    a clause to put after "after a warm-up round"; empty where there was no lead-in (results
    written before it); then the settling rounds' limit (``settings["settle_rounds"]``,
    harness's ``Group.settle_rounds``), where there was one."""
    seconds = settings.get("lead_in_s", 0.0)
    text = ""
    if seconds:
        text = (f", a step under {seconds:g} s timed after {seconds:g} s of untimed steps of its "
                "own")
    if settings.get("settle_rounds"):
        text += (f", and up to {settings['settle_rounds']} more untimed rounds while a "
                 "configuration's steps faulted in over 1 MiB of fresh memory on a rank")
    if settings.get("more_rounds"):
        text += (f"; up to {settings['more_rounds']} more timed rounds while a configuration's "
                 f"timings spread by over {settings['max_spread']:.0%} (half their "
                 "interquartile range over their median)")
    return text


def load_sentence(load: dict[str, Any]) -> str:
    """What other processes (and the hypervisor) took of the machine while the timings ran,
    in words."""
    if "others_share" not in load:
        return ""
    text = (f"During the timed rounds other processes used {load['others_share']:.0%} of the "
            f"machine's CPU time ({load['others_cpu_s']:.0f} core-s in {load['wall_s']:.0f} s)")
    if load.get("steal_s", 0) > 1:
        text += f", and the hypervisor took {load['steal_s']:.0f} core-s"
    if "retried" in load:
        limit = f"{load['max_others']:.0%}"
        who = ("other processes or the hypervisor" if load.get("steal_counted")
               else "they")  # (results written before stolen time counted)
        text += (f"; {load['retried']} timing(s) during which {who} took more than {limit} were "
                 "discarded and taken again")
        if load["kept_over_limit"]:
            text += (f", and {load['kept_over_limit']} of the {load['timings']} kept timings still "
                     f"saw more than {limit} (up to {load['max_kept_share']:.0%}): read those rows "
                     "with care")
    return text + settling_words(load) + "."


def settling_words(load: dict[str, Any]) -> str:
    """The untimed rounds run until the steps stopped faulting in fresh memory, and the timings
    that still did (``harness.py``), as a clause after a semicolon; "" when there is nothing to
    say (or the results predate the rule)."""
    text = ""
    rounds = load.get("settling_rounds", 0)
    if rounds:
        text += (f"; {plural(rounds, 'untimed round')} after the warm-up, until no configuration's "
                 "steps faulted in over 1 MiB of fresh memory on a rank")
        if load.get("unsettled"):
            text += f" ({', '.join(load['unsettled'])} still did: the limit of rounds)"
    if load.get("extra_rounds"):
        text += (f"; {plural(load['extra_rounds'], 'more timed round')}: a configuration's "
                 "timings spread by more than the limit")
    if load.get("retaken_fresh"):
        text += (f"; {load['retaken_fresh']} timing(s) whose steps faulted in fresh memory taken "
                 "again")
    if load.get("faulted_timings"):
        text += (f"; {load['faulted_timings']} of the {load['timings']} kept timings faulted in "
                 "fresh memory")
    return text


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def despine(ax: Any) -> None:
    """No top or right frame line on ``ax``."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def save_figure(fig: Any, path: Path) -> str:
    """Write ``fig`` to ``path`` (PNG at the figure's dpi), close it; the file's name."""
    fig.savefig(path)
    pyplot().close(fig)
    return path.name
