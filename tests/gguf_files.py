"""GGUF files the tests make from the default model's: rewritten without some tensors, under
another architecture name, or with some tensors in another format."""
from __future__ import annotations

import numpy as np


def copy_gguf(source, target, drop=(), arch=None, as_f16=(), fields=None, edit=None, added=None):
    """`source` rewritten without the tensors in `drop`, under another architecture name, with
    the tensors whose names contain a string of `as_f16` de-quantized and stored as F16 (a format
    no block kernel reads, as a Q4_K_M file's Q5_K tensors), `fields` {name: value} replacing
    metadata values, `added` {name: (value, GGUFValueType)} new ones, and `edit` {tensor name:
    f(raw bytes array) -> array} changing tensors."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(target), arch or reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        extra = {"sub_type": field.types[-1]} if kind == GGUFValueType.ARRAY else {}
        writer.add_key_value(name, (fields or {}).get(name, field.contents()), kind, **extra)
    for name, (value, kind) in (added or {}).items():
        writer.add_key_value(name, value, kind)
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        if any(part in tensor.name for part in as_f16):
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
            writer.add_tensor(tensor.name, values, raw_dtype=GGMLQuantizationType.F16)
        else:
            data = (edit or {}).get(tensor.name, lambda raw: raw)(np.array(tensor.data))
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
