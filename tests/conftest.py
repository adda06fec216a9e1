"""This folder's conftest puts tests/ on sys.path, for helpers that more than one test folder uses
(megatron_on_cpu.py)."""
