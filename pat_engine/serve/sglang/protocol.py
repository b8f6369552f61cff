"""SGLang's native request bodies, as pydantic models (field names and defaults of SGLang 0.5.x ``io_struct``).

Every model forbids fields it does not define, so a typo is a 400 naming
the field. Fields SGLang defines that pat-serve accepts but has no use for
(``log_metrics``, ``flush_cache``, ``torch_empty_cache``, ...) are declared
and ignored, so SGLang's own clients (slime, AReaL, sglang-router) pass.
Which sampling parameters pat-engine does not support yet is decided in
``translate.py``, not here: the schema takes what SGLang takes.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SGLSamplingParams(_Strict):
    """``sampling_params`` of ``/generate`` (SGLang's ``SamplingParams`` constructor arguments)."""

    max_new_tokens: Optional[StrictInt] = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = -1
    min_p: float = 0.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    n: StrictInt = 1
    sampling_seed: Optional[StrictInt] = None
    min_new_tokens: StrictInt = Field(default=0, ge=0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    custom_params: Optional[dict[str, Any]] = None


class GenerateRequest(_Strict):
    """``POST /generate``: one prompt or a batch (``text`` or ``input_ids``), SGLang's ``GenerateReqInput``."""

    text: Optional[Union[StrictStr, list[StrictStr]]] = None
    input_ids: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    # one dict for every prompt or one per prompt; checked against SGLSamplingParams in translate.py, per prompt,
    # so an error names the field rather than both branches of a union
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[StrictStr, list[StrictStr]]] = None
    return_logprob: Optional[Union[StrictBool, list[StrictBool]]] = None
    logprob_start_len: Optional[Union[StrictInt, list[StrictInt]]] = None
    top_logprobs_num: Optional[Union[StrictInt, list[StrictInt]]] = None
    token_ids_logprob: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    log_metrics: StrictBool = True
    return_hidden_states: Union[StrictBool, list[StrictBool]] = False
    input_embeds: Optional[list] = None
    image_data: Optional[Any] = None
    video_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    modalities: Optional[list] = None
    session_params: Optional[dict] = None
    lora_path: Optional[Union[str, list[Optional[str]]]] = None
    custom_logit_processor: Optional[Union[str, list[Optional[str]]]] = None
    bootstrap_host: Optional[Any] = None
    bootstrap_port: Optional[Any] = None
    bootstrap_room: Optional[Any] = None
    data_parallel_rank: Optional[int] = None
    routed_dp_rank: Optional[int] = None
    # added by sglang-router (0.3.x) to every request it forwards; not GenerateReqInput fields
    model: Optional[str] = None
    background: Optional[bool] = None
    no_logs: Optional[bool] = None
    return_bytes: Optional[bool] = None
    return_entropy: Optional[bool] = None


ROUTER_FIELDS = {"model", "background", "no_logs", "return_bytes", "return_entropy"}


class AbortRequest(_Strict):
    """``POST /abort_request``: one ``rid`` (an unknown one is not an error, as in SGLang) or ``abort_all``."""

    rid: StrictStr = ""
    abort_all: StrictBool = False
    finished_reason: Optional[dict] = None
    abort_message: Optional[str] = None


class PauseRequest(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"  # SGLang's default


class ContinueRequest(_Strict):
    torch_empty_cache: StrictBool = True


class _WeightUpdateCommon(_Strict):
    weight_version: Optional[StrictStr] = None
    abort_all_requests: StrictBool = False
    flush_cache: StrictBool = True
    load_format: Optional[str] = None
    torch_empty_cache: StrictBool = False


class UpdateFromDiskRequest(_WeightUpdateCommon):
    model_path: StrictStr
    is_async: StrictBool = False
    keep_pause: StrictBool = False
    recapture_cuda_graph: StrictBool = False
    token_step: int = 0


class InitUpdateGroupRequest(_Strict):
    master_address: StrictStr
    master_port: StrictInt = Field(ge=1, le=65535)
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: StrictStr = "weight_update_group"
    backend: Optional[StrictStr] = None  # SGLang's default is "nccl"; pat picks gloo on CPU, NCCL on GPU


class DestroyUpdateGroupRequest(_Strict):
    group_name: StrictStr = "weight_update_group"


class UpdateFromDistributedRequest(_WeightUpdateCommon):
    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = "weight_update_group"
    selector: Literal["target", "draft", "all"] = "all"


class UpdateFromTensorRequest(_WeightUpdateCommon):
    """Each entry: base64 of ``torch.save([(name, tensor), ...])`` (by value, loaded with ``weights_only=True``),
    or SGLang's ``MultiprocessingSerializer`` bytes (by handle: CUDA IPC / shared memory), one per rank."""

    serialized_named_tensors: list[StrictStr]
    selector: Literal["target", "draft", "all"] = "all"


class MemoryTagsRequest(_Strict):
    tags: Optional[list[Literal["weights", "kv_cache", "cuda_graph"]]] = None
