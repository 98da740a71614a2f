"""Adapters for training frameworks (:mod:`.lightning`, :mod:`.transformers`, :mod:`.accelerate`;
torchtitan: a recipe in docs/integrations.md), ``zerostall export`` (:mod:`.export`) and the DCP
storage (:mod:`.dcp_writer`, :mod:`.dcp_reader`). Nothing here is imported by ``import zerostall``;
importing an adapter imports its framework.
"""
