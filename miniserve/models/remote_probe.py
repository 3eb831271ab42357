"""What a remote server is (miniserve/models/remote.py): its flavor (vLLM, llama.cpp, Ollama,
llama-cpp-python, MiniServeLM or another OpenAI-compatible API), the model it serves, its
context, whether the model has a chat template and which tokenize endpoint counts tokens.
Asked once, when the engine is built: one GET /v1/models, then the server's own endpoints."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from miniserve.core.config import CONTEXT
from miniserve.models.remote_http import PROBE_TIMEOUT, _json, _network_reason, _what
from miniserve.runners.loader import ModelLoadError


@dataclass
class ServerFacts:
    """What the construction learned from the server."""

    flavor: str  # vllm | llama.cpp | ollama | llama-cpp-python | miniserve | openai
    served: str  # the model name to send
    context: int | None  # what the server reports, if it does
    context_from: str  # where `context` came from
    chat: bool = True  # False: the server says the model has no chat template
    tokenize: str = ""  # vllm | llama.cpp | extras | "" (estimate)


class ServerProbe:
    """RemoteEngine's questions to its server (a mixin: it reads the engine's `client`, `url`
    and `spec`, and the `facts` its construction keeps)."""

    @property
    def root(self) -> str:
        """The server's address without /v1: where vLLM's and llama.cpp's own endpoints are."""
        return self.url[:-3] if self.url.endswith("/v1") else self.url

    def _discover(self) -> ServerFacts:
        """One GET /v1/models (which must answer as OpenAI's does), then what the server's own
        endpoints say about the context, the chat template and token counts."""
        models = self._list_models()
        served = self._served(models)
        entry = next((m for m in models if m.get("id") == served), {})
        facts = ServerFacts(_flavor(entry), served, None, "")
        if isinstance(entry.get("max_model_len"), int):  # vLLM
            facts.context, facts.context_from = entry["max_model_len"], "vLLM max_model_len"
            facts.tokenize = "vllm"
        elif isinstance(entry.get("context_length"), int):  # MiniServeLM
            facts.context, facts.context_from = (
                entry["context_length"],
                "the server's /v1/models context_length",
            )
            facts.chat = entry.get("chat") is not False
        if facts.flavor in ("llama.cpp", "openai"):
            self._ask_llamacpp(facts)
        if facts.flavor in ("ollama", "openai"):
            self._ask_ollama(facts)
        if not facts.tokenize and facts.flavor in ("miniserve", "openai"):  # vLLM's form
            counted = self._probe("POST", "/tokenize", {"model": served, "prompt": "a"})
            if isinstance(counted, dict) and isinstance(counted.get("count"), int):
                facts.tokenize = "vllm"
                if not facts.context and isinstance(counted.get("max_model_len"), int):
                    # a MiniServeLM whose model was not loaded yet: this request loaded it
                    facts.context = counted["max_model_len"]
                    facts.context_from = "the server's /tokenize max_model_len"
        if not facts.tokenize and facts.flavor in ("llama-cpp-python", "openai"):
            if self._probe("POST", "/extras/tokenize", {"input": "a"}) is not None:
                facts.tokenize = "extras"
                facts.flavor = "llama-cpp-python"
        return facts

    def _list_models(self) -> list[dict]:
        """The server's models; ModelLoadError naming the URL when it does not answer as an
        OpenAI-compatible API (tries URL/v1 too when the URL has no /v1)."""
        tried = [self.url] + ([] if self.url.endswith("/v1") else [self.url + "/v1"])
        reason = ""
        for url in tried:
            try:
                r = self.client.get(url + "/models", timeout=PROBE_TIMEOUT)
            except httpx.HTTPError as e:
                raise ModelLoadError(
                    f"cannot reach an OpenAI-compatible server at {self.url}: {_network_reason(e)}"
                ) from None
            if r.status_code in (401, 403):
                raise ModelLoadError(
                    f"the server at {self.url} asks for an API key: pass "
                    "--remote-api-key KEY (or set MINISERVE_REMOTE_API_KEY)"
                    if not self.spec.api_key
                    else f"the server at {self.url} refused the API key given ({r.status_code})"
                )
            data = _json(r)
            if (
                r.status_code == 200
                and isinstance(data, dict)
                and isinstance(data.get("data"), list)
            ):
                self.url = url
                return [m for m in data["data"] if isinstance(m, dict)]
            reason = reason or f"GET {url}/models answered {r.status_code} " + (
                "with JSON that is not a model list" if data is not None else f"with {_what(r)}"
            )
        raise ModelLoadError(
            f"{self.url} is not an OpenAI-compatible API ({reason}); give the "
            "server's address ending in /v1, e.g. http://HOST:8000/v1"
        )

    def _served(self, models: list[dict]) -> str:
        ids = [m["id"] for m in models if isinstance(m.get("id"), str)]
        wanted = self.spec.served_name
        if wanted:
            if ids and wanted not in ids:
                raise ModelLoadError(
                    f"the server at {self.url} does not serve '{wanted}'; it "
                    f"serves: {', '.join(ids)}"
                )
            return wanted
        if not ids:
            raise ModelLoadError(
                f"the server at {self.url} lists no models: name one with {self.url}#MODEL"
            )
        return ids[0]

    def _ask_llamacpp(self, facts: ServerFacts) -> None:
        """llama.cpp's llama-server: /props has the context of a slot and the template."""
        props = self._probe("GET", "/props")
        if not isinstance(props, dict) or "default_generation_settings" not in props:
            return
        facts.flavor, facts.tokenize = "llama.cpp", "llama.cpp"
        if props.get("chat_template") == "":
            facts.chat = False
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get("n_ctx")
        if not isinstance(n_ctx, int):  # older servers: per slot
            slots = self._probe("GET", "/slots")
            n_ctx = (
                slots[0].get("n_ctx")
                if isinstance(slots, list) and slots and isinstance(slots[0], dict)
                else None
            )
        if isinstance(n_ctx, int) and n_ctx > 0:
            facts.context, facts.context_from = n_ctx, "llama.cpp /props n_ctx"

    def _ask_ollama(self, facts: ServerFacts) -> None:
        """Ollama: /api/show has the model's parameters (num_ctx, when its Modelfile sets it)
        and its template. Without num_ctx Ollama runs its own default context, not the one the
        model was trained for: --context, or the default, is then the honest guess."""
        show = self._probe("POST", "/api/show", {"model": facts.served})
        if not isinstance(show, dict) or "modelfile" not in show and "model_info" not in show:
            return
        facts.flavor = "ollama"
        if show.get("template") == "":
            facts.chat = False
        for line in str(show.get("parameters") or "").splitlines():
            key, _, value = line.strip().partition(" ")
            if key == "num_ctx" and value.strip().isdigit():
                facts.context, facts.context_from = int(value), "Ollama /api/show num_ctx"

    def _probe(self, method: str, path: str, body: dict | None = None):
        """JSON from one of the server's own endpoints, or None (absent, or not JSON)."""
        try:
            r = self.client.request(method, self.root + path, json=body, timeout=PROBE_TIMEOUT)
        except httpx.HTTPError:
            return None
        return _json(r) if r.status_code == 200 else None

    def _context(self) -> tuple[int, str]:
        if self.facts.context:
            return self.facts.context, self.facts.context_from
        if self.spec.context:
            return self.spec.context, "--context (the server does not say)"
        return int(CONTEXT.default), "the default (the server does not say; set --context)"


def _flavor(entry: dict) -> str:
    """Which server, from its /v1/models entry (confirmed by its own endpoints later)."""
    owner = str(entry.get("owned_by", "")).lower()
    if "max_model_len" in entry or owner == "vllm":
        return "vllm"
    if owner == "llamacpp":
        return "llama.cpp"
    if owner in ("library", "ollama"):
        return "ollama"
    if owner == "miniserve" or "context_length" in entry:
        return "miniserve"
    if owner == "me":  # llama-cpp-python's server
        return "llama-cpp-python"
    return "openai"
