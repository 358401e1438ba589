"""OpenAI's error answers, one place for their status, type and code.

Every error the server sends is OpenAI's error object {"error": {"message", "type", "param", "code"}}
(``protocol.error_body``). The statuses, types and codes follow the OpenAI API reference ("Error codes"):

  status  type                   code                      when
  400     invalid_request_error  null                      a field is missing, of the wrong type or value
                                                           (param names it)
  400     invalid_request_error  context_length_exceeded   the prompt, or prompt + max_tokens, exceeds the
                                                           context (param "prompt" / "messages" / "input" /
                                                           "max_tokens")
  400     invalid_request_error  unknown_field             a field no part of the server reads, with
                                                           ``serve --strict-fields`` (param names it)
  401     authentication_error   invalid_api_key           ``serve --api-key`` set and the request's key is
                                                           missing or wrong (OpenAI says
                                                           invalid_request_error here; authentication_error
                                                           is llama-server's and Anthropic's type, and what
                                                           the openai client maps 401 to)
  404     invalid_request_error  model_not_found           ``model`` names a model this server does not serve
                                                           (also GET /v1/models/{id})
  404     invalid_request_error  null                      an unknown path (param null)
  413     invalid_request_error  request_too_large         the body is over ``serve --max-request-bytes``
  429     rate_limit_error       queue_full                the waiting queue is full (Retry-After set)
  500     server_error           null                      generation failed
  503     server_error           null                      the engine is not running

The official ``openai`` client raises BadRequestError (400), AuthenticationError (401), NotFoundError (404),
RateLimitError (429) and InternalServerError (>= 500) for these.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .protocol import error_body
from .request import RequestError

MODEL_NOT_FOUND = "model_not_found"
INVALID_API_KEY = "invalid_api_key"
UNKNOWN_FIELD = "unknown_field"


class ModelNotFound(RequestError):
    """``model`` names a model this server does not serve: answered 404 with code model_not_found."""

    def __init__(self, asked: str, served: str):
        super().__init__("model", f"The model {asked!r} does not exist: this server serves {served!r} "
                         "(GET /v1/models lists it)", MODEL_NOT_FOUND)


def check_model(asked: str | None, served: str, aliases=()) -> None:
    """Raise ModelNotFound when a request's ``model`` is given and is neither the served model's name nor one
    of its ``aliases`` (``serve --model-alias``)."""
    if asked is not None and asked != served and asked not in aliases:
        raise ModelNotFound(asked, served)


def request_error_response(err: RequestError) -> JSONResponse:
    """The answer to a refused request: 404 for an unknown model, 400 otherwise, with the error's param and
    code (``RequestError.field``, ``RequestError.code``)."""
    status = 404 if isinstance(err, ModelNotFound) else 400
    return JSONResponse(error_body(str(err), err.field, "invalid_request_error", getattr(err, "code", None)),
                        status_code=status)


def unauthorized_body(message: str) -> dict:
    """The 401 error object of a missing or wrong API key."""
    return error_body(message, None, "authentication_error", INVALID_API_KEY)
