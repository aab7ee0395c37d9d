#!/usr/bin/env python3
"""Decompose the rollout-vs-trainer gap of an MoE model into weight and activation error.

Thin wrapper over ``megatron-quads analyze`` (same arguments); see megatron_quads/analyze.py.
"""

import sys

from megatron_quads.cli import main

if __name__ == "__main__":
    sys.exit(main(["analyze", *sys.argv[1:]]))
