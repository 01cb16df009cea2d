"""MPS control daemons: one per GPU or MIG device, driven through ``nvidia-cuda-mps-control``.

``control`` is what the node agent uses; ``standin`` is a program with the same command-line
contract for machines without a GPU (the agent runs whichever binary it is configured with).
"""
