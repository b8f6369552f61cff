"""``/update_weights_from_tensor``'s ``serialized_named_tensors``: SGLang's by-handle pickles, or ``torch.save``
files of ``(name, tensor)`` pairs, decoded safely (handles are rebuilt on the workers with an
allowlisting unpickler; files load with ``weights_only=True``)."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import torch

from pat_engine.errors import InvalidRequestError

HANDLE_FORMATS = (None, "direct")  # SGLang's load_format values that mean "load these tensors as they are"


def _is_pickle(raw: bytes) -> bool:
    return len(raw) >= 2 and raw[0] == 0x80  # pickle's PROTO opcode; a torch.save file is a zip ("PK")


def decode_entries(serialized: list[str]) -> list[bytes]:
    """The base64 entries of ``serialized_named_tensors``, decoded."""
    out = []
    for i, entry in enumerate(serialized):
        try:
            out.append(base64.b64decode(entry, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError(f"serialized_named_tensors[{i}] is not base64: {exc}") from None
    return out


@dataclass(frozen=True)
class TensorPayload:
    """What ``serialized_named_tensors`` holds: handle pickles (one per rank) or named tensors by value."""

    handles: list[bytes] | None = None
    named: list[tuple[str, torch.Tensor]] | None = None


def parse_payload(serialized: list[str], load_format: str | None) -> TensorPayload:
    """Decode the entries once and tell the two forms apart. CPU work proportional to the payload (a
    by-value update can be gigabytes): the server runs it off its event loop."""
    raw = decode_entries(serialized)
    handles = handle_payloads(raw, load_format)
    return TensorPayload(handles=handles) if handles is not None else TensorPayload(named=load_named_tensors(raw))


def handle_payloads(raw: list[bytes], load_format: str | None) -> list[bytes] | None:
    """SGLang's by-handle form (``MultiprocessingSerializer`` pickles of CUDA IPC / shared-memory handles,
    one entry per rank): the payloads for ``Engine.update_weights_from_handles``, which rebuilds them on
    the workers with an allowlisting unpickler. None: the entries are ``torch.save`` files (by value)."""
    kinds = {_is_pickle(r) for r in raw}
    if kinds != {True}:
        if True in kinds:
            raise InvalidRequestError("serialized_named_tensors mixes handle pickles and torch.save files")
        return None
    if load_format not in HANDLE_FORMATS:
        raise InvalidRequestError(f"load_format={load_format!r} is not supported (pat-engine takes named tensors: "
                                  f"{HANDLE_FORMATS})")
    return raw


def load_named_tensors(raw: list[bytes]) -> list[tuple[str, torch.Tensor]]:
    """Each entry: a ``torch.save([(name, tensor), ...])`` file; loaded with ``weights_only=True``
    (plain tensors only: no code runs). Handle pickles go through ``handle_payloads`` instead."""
    out = []
    for i, entry in enumerate(raw):
        try:
            obj = torch.load(io.BytesIO(entry), weights_only=True)
        except Exception as exc:
            raise InvalidRequestError(
                f"serialized_named_tensors[{i}] is not a torch.save'd list of (name, tensor) pairs ({exc})") from None
        if not isinstance(obj, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
                for p in obj):
            raise InvalidRequestError(f"serialized_named_tensors[{i}] must hold a list of (name, tensor) pairs")
        out.extend((name, tensor) for name, tensor in obj)
    return out
