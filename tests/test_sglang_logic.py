"""Fast tier for the SGLang API: request translation, weight-version spans, retract, tensor payloads."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from driver_fixtures import expected_tokens, make_driver
from pat_engine.core.request import SeqStatus
from pat_engine.core.served_weights import INITIAL_WEIGHT_VERSION, ServedWeights
from pat_engine.errors import InvalidRequestError
from pat_engine.serve.sglang.protocol import GenerateRequest
from pat_engine.serve.sglang.translate import UNSUPPORTED_SAMPLING, generate_items
from pat_engine.serve.sglang.named_tensors import TensorPayload, parse_payload


def items(body: dict):
    return generate_items(GenerateRequest.model_validate(body), room=lambda p: 100)


def test_single_and_batch_translation():
    (one,), batch = items({"input_ids": [1, 2], "rid": "r", "sampling_params": {"max_new_tokens": 5,
                                                                                "sampling_seed": 9, "temperature": 0.5}})
    assert not batch and one.rid == "r" and one.input.prompt == [1, 2]
    p = one.input.params
    assert (p.max_new_tokens, p.seed, p.temperature, p.logprobs) == (5, 9, 0.5, False)
    many, batch = items({"text": ["a", "b"], "return_logprob": [True, False],
                         "sampling_params": [{"max_new_tokens": None}, {}]})
    assert batch and [i.input.params.max_new_tokens for i in many] == [100, 128]  # null: room; default: SGLang's 128
    assert [i.input.params.logprobs for i in many] == [True, False] and many[0].rid != many[1].rid


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_SAMPLING))
def test_every_unsupported_sampling_field_is_named(field):
    value = {"stop_regex": "x", "json_schema": "{}", "regex": "a", "ebnf": "a",
             "structural_tag": "a", "custom_params": {"a": 1}}.get(field, 0.5)
    with pytest.raises(InvalidRequestError, match=f"sampling_params.{field}="):
        items({"input_ids": [1], "sampling_params": {field: value}})
    items({"input_ids": [1], "sampling_params": {field: UNSUPPORTED_SAMPLING[field][0]}})  # its "off" value passes


def test_batch_field_lengths_must_match():
    with pytest.raises(InvalidRequestError, match="sampling_params has 1 entries for 2 prompts"):
        items({"input_ids": [[1], [2]], "sampling_params": [{}]})
    with pytest.raises(InvalidRequestError, match="prompt 1: unknown field 'sampling_params.tmp'"):
        items({"input_ids": [[1], [2]], "sampling_params": [{}, {"tmp": 1}]})


def test_weight_version_spans():
    drv = make_driver()
    seq = drv.add([1, 2, 3], 10)
    seq.weight_versions = [(0, "a")]
    assert seq.weight_version_spans(0) == [("a", 0, 0)]
    seq.weight_versions.append((4, "b"))
    seq.weight_versions.append((4, "c"))  # two updates with no token between: "b" produced nothing
    seq.weight_versions.append((7, "c"))  # a version named again: one span
    assert seq.weight_version_spans(9) == [("a", 0, 4), ("c", 4, 9)]
    assert seq.weight_version_spans(3) == [("a", 0, 3)]  # only what a snapshot of 3 tokens covers


def test_served_weights_versions():
    w = ServedWeights("m")
    assert w.version == INITIAL_WEIGHT_VERSION
    assert w.new_version() == "1" and w.new_version("step-9") == "step-9" and w.new_version() == "3"


def test_retract_frees_every_block_and_keeps_tokens():
    drv = make_driver(dp=2)
    seqs = [drv.add([i + 1, i + 2, i + 3], 30) for i in range(5)]
    drv.ticks(12)
    running = [s for s in seqs if s.status is SeqStatus.RUNNING]
    assert running
    drv.coord.stepping.drain()
    assert drv.coord.stepping.retract_all() == len(running)
    drv.coord.stepping.check_block_invariants()
    assert all(s.status is SeqStatus.WAITING and not s.block_table for s in seqs)
    assert all(sched.blocks.num_free == sched.blocks.num_blocks for sched in drv.coord.stepping.schedulers)
    drv.run()
    assert all(s.output_ids == expected_tokens(s) for s in seqs)


def _b64(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_tensor_payloads():
    t = torch.ones(2, 3)
    payload = parse_payload([_b64([("w", t)]), _b64([("v", t)])], None)
    assert payload.handles is None and [(n, x.shape) for n, x in payload.named] == [("w", (2, 3)), ("v", (2, 3))]
    with pytest.raises(InvalidRequestError, match="not base64"):
        parse_payload(["%%%"], None)
    with pytest.raises(InvalidRequestError, match="pairs"):
        parse_payload([_b64({"w": t})], None)
    with pytest.raises(InvalidRequestError, match="not a torch.save"):
        parse_payload([base64.b64encode(b"garbage").decode()], None)


def test_handle_payloads_are_told_from_torch_save_files():
    from pat_engine.model.weight_handles import serialize_named_tensors

    handle = base64.b64encode(serialize_named_tensors([("w", torch.ones(2))])).decode()
    assert parse_payload([handle, handle], "direct") == TensorPayload(handles=[base64.b64decode(handle)] * 2)
    with pytest.raises(InvalidRequestError, match="mixes"):
        parse_payload([handle, _b64([("w", torch.ones(2))])], None)
    with pytest.raises(InvalidRequestError, match="flattened_bucket"):
        parse_payload([handle], "flattened_bucket")
