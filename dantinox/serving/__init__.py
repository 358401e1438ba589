"""Serving many users: a paged KV cache, continuous batching, an explicit context policy, an HTTP server.

  allocator.py / block_pool.py   block tables, reference counts, prefix caching, copy-on-write (plain Python)
  paged_cache.py                 the device pool per layer ([N, P, K, D] k and v, or the MLA latent pool) and
                                 the paged attention views
  paged_channel_keys.py          the int8 pool with per-channel keys (KIVI): its layer type, attention, bytes
  sink_slots.py                  which per-sequence slot of an int8 pool's float32 attention sinks a sequence uses
  residual_slots.py              which per-sequence float32 residual slot (the filling key group) a sequence uses
  runner.py                      compiled forward/sample and block-move functions
  request.py                     one request's options, tokens and state
  scheduler.py                   chunked prefill + decode under a token budget; admission; preemption
  step_plan.py                   the host arithmetic of one engine step (shared with plan/simulate.py)
  speculation.py / verify_step.py  speculative decoding: the host rule (which rows, switch-off) and the n-gram
                                 verify call; draft_model.py / draft_verify.py: a draft model's layers beside
                                 the target's under the same block tables, and its propose-and-verify call
  engine.py                      the Engine interface and PagedEngine; sharded_engine.py: the same on a mesh
  worker.py / server.py          the engine thread and the OpenAI-compatible FastAPI app
  completions.py                 /v1/completions: validation, choices, stop strings, disconnects
  chat_endpoint.py               /v1/chat/completions
  request_limits.py              the request body limit (413); a prompt over the context by its characters
  grammar_rows.py                structured outputs in the engine: matchers, the step's token mask
  structured_request.py          response_format / structured_outputs / guided_* -> a constraint
  tool_calls.py / tool_chat.py   tools, tool_choice, tool-call parsers and the forcing grammar; the
                                 chat answer with tool_calls, whole or streamed
  metrics.py / protocol.py       Prometheus metrics; the completions request/response format
  session_endpoints.py           POST /sessions/save and /sessions/restore (a prompt's KV blocks in a file)

``dantinox serve`` lives in ``dantinox/cli/serve.py``. The HTTP modules (server, completions, chat_endpoint,
request_limits, worker, metrics, protocol, session_endpoints) are not imported here, so the engine works without
FastAPI installed.
"""

from ..kv.allocator import BlockAllocator
from ..kv.block_pool import BlockPool, NoFreeBlocksError
from .engine import Engine, EngineConfig, PagedEngine
from ..kv.pool import init_pool
from ..kv.sizes import blocks_for_memory
from .request import QueueFullError, RequestError, RequestOutput, SamplingOptions
from .scheduler import ContextPolicy

__all__ = ["BlockAllocator", "BlockPool", "ContextPolicy", "Engine", "EngineConfig", "NoFreeBlocksError",
           "PagedEngine", "QueueFullError", "RequestError", "RequestOutput", "SamplingOptions", "init_pool",
           "blocks_for_memory"]
