"""What the tests share and the package does not ship: the PTX interpreter that runs the
EP kernels on the CPU (``ptxsim``), the EP operations' torch references
(``ep_reference``), and a compile backend that keeps its plans (``plans``). On the
import path through pyproject.toml's ``pythonpath`` (``tests``)."""
