"""``/tokenize`` and ``/detokenize`` (vLLM's): the server's own tokenizer and chat template, so a client
can count and inspect tokens exactly as a completion would see them."""

from __future__ import annotations

import asyncio

from services.frontend.errors import ApiError
from services.frontend.pipeline import Pipeline
from services.frontend.embeds import prompt_size
from services.frontend.prompt import media_parts, template_options
from services.frontend.text_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


async def tokenize(pipeline: Pipeline, request: TokenizeRequest) -> TokenizeResponse:
    if request.prompt is not None:
        ids = await _in_prompt_thread(pipeline, pipeline.text_prompt, request.prompt, request.add_special_tokens is not False)
    else:
        parts = [(kind, part) for kind, part in media_parts(request.messages) if kind != "video"]
        if len(parts) > pipeline.settings.limit_mm_per_prompt["image"]:
            raise ApiError(400, f"too many images: {len(parts)}", "messages")
        # their sizes (or given grids) decide how many placeholder tokens each gets
        images = await pipeline.media.load_media(parts, pipeline.embeds)
        prompt = await _in_prompt_thread(pipeline, pipeline.builder.build, request.messages,
                                         [prompt_size(i) for i in images], template_options(request))
        ids = prompt.token_ids
    strs = pipeline.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=pipeline.max_model_len, tokens=ids, token_strs=strs)


async def _in_prompt_thread(pipeline: Pipeline, fn, *args):
    """Where the pipeline tokenizes: one prompt at a time (the tokenizer's special-token switch is state)."""
    return await asyncio.get_running_loop().run_in_executor(pipeline.prompts, fn, *args)


async def detokenize(pipeline: Pipeline, request: DetokenizeRequest) -> DetokenizeResponse:
    vocab = pipeline.sampling.vocab_size
    if any(t >= vocab for t in request.tokens):
        raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", "tokens")
    return DetokenizeResponse(prompt=pipeline.tokenizer.decode(request.tokens))
