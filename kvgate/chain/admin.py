"""Admin routes for the request chain, for operators holding an admin key.

    GET  /admin/admission                          queue lengths, active and queued requests
                                                   per tenant, open quota reservations
    POST /admin/explain/v1/chat/completions?tenant=NAME   (or any other inference path)
                                                   how a request would be classified: the
                                                   matching rule, class, deadline, priority

With `auth: none` (or no `auth:`) these routes are open like everything else.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import orjson

from kvgate.asgi import JSON, Receive, Scope, Send, send_bytes, send_error
from kvgate.chain.admission import AdmissionController
from kvgate.chain.auth import Authenticator
from kvgate.chain.classify import Classifier
from kvgate.chain.intent import CLASSES_BY_RANK, request_priority
from kvgate.chain.settings import ClassificationConfig
from kvgate.chain.tenants import TenantDirectory
from kvgate.errors import InvalidRequest, KvgateError, MethodNotAllowed, NotFound
from kvgate.ingress import (
    INFERENCE_ROUTES,
    ClientGone,
    parse_payload,
    read_body,
    request_context,
)
from kvgate.types import Headers

_EXPLAIN = "/admin/explain"
_MAX_EXPLAIN_BODY = 1024 * 1024


class AdminRoutes:
    def __init__(
        self,
        directory: TenantDirectory,
        classifier: Classifier,
        admission: AdmissionController,
        estimate: ClassificationConfig,
    ) -> None:
        self.estimate = estimate  # how prompt tokens are estimated
        self.directory = directory
        self.authenticator = Authenticator(directory)
        self.classifier = classifier
        self.admission = admission

    def authorize(self, headers: Headers) -> str | None:
        """Raises (401/403) unless the headers carry an admin key or auth is open; the key's
        id (None on an open gateway), for the log lines of what an admin changes."""
        if self.directory.open:
            return None
        return self.authenticator.verify_admin(headers).key_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            self.authorize(scope["headers"])
            path, method = scope["path"], scope["method"]
            if path == "/admin/admission":
                if method != "GET":
                    raise MethodNotAllowed(f"{method} is not allowed on {path}; use GET")
                await send_bytes(send, 200, orjson.dumps(self._admission_state()), JSON)
            elif path.startswith(_EXPLAIN) and path[len(_EXPLAIN) :] in INFERENCE_ROUTES:
                if method != "POST":
                    raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST")
                body = await self._explain(scope, receive, path[len(_EXPLAIN) :])
                await send_bytes(send, 200, orjson.dumps(body), JSON)
            else:
                raise NotFound(f"Unknown route {method} {path}", code="unknown_url")
        except ClientGone:
            return
        except KvgateError as error:
            await send_error(send, error)

    def _admission_state(self) -> dict[str, object]:
        requests, tokens = self.admission.quotas.outstanding()
        queue = self.admission.queue
        return {
            "queued": {name: queue.length(rank) for rank, name in enumerate(CLASSES_BY_RANK)},
            "active_by_tenant": {t: n for t, n in self.admission.active.items() if n},
            "queued_by_tenant": {t: n for t, n in self.admission.queued.items() if n},
            "open_reservations": {"requests": requests, "tokens": tokens},
        }

    async def _explain(
        self, scope: Scope, receive: Receive, inference_path: str
    ) -> dict[str, object]:
        body = await read_body(scope["headers"], receive, _MAX_EXPLAIN_BODY)
        route = INFERENCE_ROUTES[inference_path]
        payload, model, _ = parse_payload(route, body)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        name = query.get("tenant", [None])[0]
        if name is None and not self.directory.open:
            raise InvalidRequest(
                "Name the tenant to explain for (?tenant=NAME): this gateway serves no "
                "anonymous requests",
                param="tenant",
                code="missing_required_parameter",
            )
        tenant = self.directory.anonymous if name is None else self.directory.tenants.get(name)
        if tenant is None:
            raise NotFound(f"No tenant named '{name}'", param="tenant", code="unknown_tenant")
        ctx = request_context(
            route,
            payload,
            headers=scope["headers"],
            body=body,
            chars_per_token=self.estimate.chars_per_token,
            media_tokens=self.estimate.media_tokens,
        )
        intent = self.classifier.classify(ctx, tenant)
        return {
            "tenant": tenant.name,
            # False: the tenant's key would be refused this model (403 model_not_allowed).
            "model_allowed": tenant.may_use(model),
            "intent": intent.explain(),
            "priority": request_priority(intent.latency_class, tenant.tier_priority),
            "predicted_ttft_seconds": round(self.admission.predicted_ttft(model), 4),
            "rules": [rule.name for rule in self.classifier.rules],
        }
