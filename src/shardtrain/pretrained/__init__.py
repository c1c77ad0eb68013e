"""Fine-tuning from pretrained Hugging Face checkpoints: sharded reading, export back, LoRA.

files   which safetensors files hold a model, and their headers
bnb_layout  weights already quantised by bitsandbytes: one entry per weight, dequantised as read
keys    model parameter names <-> file keys (peft, base-model prefix, tied weights)
load    st.load_pretrained: each rank reads only the rows it holds
layout  how an export is split into files, as save_pretrained splits them
merge   LoRA adapters merged into their weights while exporting
export  st.save_pretrained: a Hugging Face folder, streamed one unit at a time
lora    peft's LoRA applied to a model built on the meta device
nf4     a frozen linear layer stored in 4 bits (torchao's NF4 format)
qlora   st.quantize_base: a LoRA model's frozen linear layers made NF4, loaded and exported through it
"""

from .export import install_save_pretrained, save_pretrained
from .load import LoadReport, load_pretrained
from .qlora import quantize_base

__all__ = ["LoadReport", "install_save_pretrained", "load_pretrained", "quantize_base", "save_pretrained"]
