"""Expert-parallel communication inside one NVLink domain (DeepEP's intranode normal
mode): the dispatch layout, the dispatch and the combine, over rings in every rank's
communication buffer (plan.py). The host side is ``ptxforge.ep``."""
