"""OpenAI request bodies, validated with the limits OpenAI documents, plus vLLM's extensions
(top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, prompt_logprobs, structured_outputs and the older guided_*,
chat_template, chat_template_kwargs, return_tokens_as_token_ids). Every field is range-checked
here, at the edge: numbers must fit the tensors they end up in, strings must be valid Unicode
(JSON lets a lone surrogate through; nothing downstream can encode it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool

from tandem.core.llm.sampling_params import MAX_INT, MAX_LOGPROBS, MAX_REPETITION_PENALTY


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return text


def _valid_json_text(value: Any) -> Any:
    """Every string in a JSON value (keys included) is valid Unicode."""
    if isinstance(value, str):
        _valid_unicode(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _valid_json_text(key)
            _valid_json_text(item)
    elif isinstance(value, list):
        for item in value:
            _valid_json_text(item)
    return value


# A string that is valid Unicode; a number that is a JSON number (not "0.5", not true); an
# integer; a token id that fits the engine's tensors; any JSON object whose text is valid.
StrictStr = Annotated[str, Strict(), AfterValidator(_valid_unicode)]
Number = Annotated[float, Strict()]
StrictInt = Annotated[int, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_INT)]
JsonObject = Annotated[dict[StrictStr, Any], AfterValidator(_valid_json_text)]
# Stop strings and stop token ids a request may give.
MAX_STOPS = 64


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers commonly do.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Request):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Request):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    # "schema" would shadow pydantic's own attribute of that name.
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's structured_outputs: exactly one of its constraints."""

    json_: JsonObject | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class _SamplingFields(_Request):
    # Fields no model here declares are kept aside (``model_extra``): those a logits-processor
    # plugin declares become its SamplingParams.extra (generation.py); the rest are ignored.
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: StrictStr
    temperature: Number | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=MAX_INT)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOPS)] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_p: Number | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: StrictInt = Field(default=0, ge=0, le=MAX_INT)
    # Token ids (as strings, as OpenAI sends them) -> bias; each checked in generation.py.
    logit_bias: dict[StrictStr, Number] | None = None
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: StrictBool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: JsonObject | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1)
    guided_grammar: StrictStr | None = None
    user: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo: the prompt scored, nothing generated (what evaluation harnesses send).
    max_tokens: StrictInt | None = Field(default=16, ge=0, le=MAX_INT)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Request):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Request):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class MediaPart(_Request):
    """Image, video, audio or file content (OpenAI's and vLLM's part types), parsed only so
    that it can be refused with a clear message: the models are served for text."""

    type: Literal[
        "image_url", "input_image", "image", "video_url", "video", "input_audio", "audio_url",
        "file",
    ]  # fmt: skip


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class ChatMessage(_Request):
    # Any string here: chat.py names the message in its error (messages[i].role).
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # Sent back by clients of reasoning models; templates such as Qwen3's read it.
    reasoning_content: StrictStr | None = None

    def media_types(self) -> list[str]:
        """The non-text part types of this message's content, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.type for part in self.content if isinstance(part, MediaPart)]

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class FunctionDefinition(_Request):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: JsonObject | None = None
    strict: StrictBool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_INT)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_INT)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # A template of the request's own: refused unless the operator trusts request templates
    # (--trust-request-chat-template).
    chat_template: StrictStr | None = None
    chat_template_kwargs: JsonObject | None = None
    add_generation_prompt: StrictBool = True


class TokenizeRequest(_Request):
    """POST /tokenize: a prompt, or chat messages rendered by the chat template (vLLM's)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: JsonObject | None = None


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[TokenId]
