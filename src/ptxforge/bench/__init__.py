"""The benchmark suites behind ``ptxforge bench``, each a module with its suite (a dict of
results, what ``--json`` writes), its table and its plot: ``ops`` (the memory-bound ops,
the FP8, grouped and BF16 GEMMs, the decode GEMMs, the PDL chain, and the timer, copies
and operands they share), ``model`` (models compiled by the backend), ``onnx`` (an
exported model through the ONNX front end), ``ep`` (expert-parallel dispatch and
combine). Here: the table printer and the plotting set-up they share, which import no
torch (the CLI prints its other tables with the same printer)."""

from __future__ import annotations


def format_table(headers: list, rows: list) -> str:
    """A Markdown table, each column right-aligned to its widest cell."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def pyplot():
    """matplotlib's pyplot drawing to files (the Agg backend), or None, said on stdout,
    where matplotlib is not installed: a plot is optional."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return None
    return plt
