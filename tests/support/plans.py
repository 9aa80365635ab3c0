"""A torch.compile backend that keeps the plans it makes, for tests to assert on."""

from __future__ import annotations

from ptxforge import compiler


class PlanRecorder:
    """A torch.compile backend: ptxforge's with ``options`` (e.g. ``fp8=False``), keeping
    the plan of each graph it compiles in ``plans``."""

    def __init__(self, **options):
        self.options, self.plans = options, []

    def __call__(self, gm, example_inputs):
        compiled = compiler.backend(gm, example_inputs, **self.options)
        self.plans.append(gm.ptxforge_plan)
        return compiled
