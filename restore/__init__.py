"""The restore service: assemble verified global tensors from any tier and write them in a target layout."""
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.restore.export import export_safetensors

__all__ = ["assemble_tensor", "export_safetensors"]
