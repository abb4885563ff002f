"""The folder ``python -m zmqautograd.run`` puts first on ``PYTHONPATH`` (its ``sitecustomize``)."""
