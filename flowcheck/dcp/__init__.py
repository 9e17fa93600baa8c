"""flowcheck as a PyTorch DCP storage backend: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` to flowcheck's tiers.

``Writer`` (flowcheck/dcp/writer.py) saves every rank's chunks as one step — each rank a part, the coordinator
commits (flowcheck/dcp/parts.py); ``Reader`` (flowcheck/dcp/reader.py) loads any stored step through DCP's own
resharding planner.  Keys and non-tensor items: flowcheck/dcp/index.py, flowcheck/dcp/objects.py.
"""
from flowcheck.dcp.index import PushKeys
from flowcheck.dcp.reader import LoadMismatchError, Reader
from flowcheck.dcp.target import DcpPlanError
from flowcheck.dcp.writer import Writer

__all__ = ["DcpPlanError", "LoadMismatchError", "PushKeys", "Reader", "Writer"]
