"""The restore service: verified global tensors from any tier, resharded into a Megatron layout, or imported from one."""
from flowcheck.restore.assemble import assemble_tensor
from flowcheck.restore.export import export_file, export_safetensors

__all__ = ["assemble_tensor", "export_file", "export_safetensors"]
