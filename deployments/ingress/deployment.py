"""The Ingress deployment: the HTTP surface of the graph (FastAPI, built per replica).

The FastAPI app is built after the constructor (`__serve_build_asgi_app__`), so its routes close over
this replica's handles to the Renderer, Scheduler, ResponseStore and (with `--slide`) Slide deployments
instead of living on the class.
"""

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.ingress.app import build_api
from deployments.ingress.backend import GraphBackend
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.drain import Drain
from deployments.ingress.http.key_store import KeyStore
from deployments.log_setup import configure_logging
from deployments.serve_sockets import configure_serve_sockets


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1024)
@serve.ingress()
class Ingress:
    def __init__(
        self,
        renderer: DeploymentHandle,
        scheduler: DeploymentHandle,
        settings: IngressSettings,
        responses: DeploymentHandle,
        slide: DeploymentHandle | None = None,
    ) -> None:
        configure_logging()  # the finish log
        configure_serve_sockets()  # before Serve binds this replica's gRPC server and HTTP port
        self._backend = GraphBackend(renderer, scheduler, responses, slide)
        self._settings = settings
        self._keys = KeyStore(settings.auth)  # reached by reload_keys as well as by the app's auth
        self._drain = Drain()  # reached by drain as well as by the app's middleware and /health

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self._backend, self._settings, self._keys, self._drain)

    async def drain(self, grace_s: float) -> str:
        """A planned stop (http/drain.py): `tensorfold serve` broadcasts it on SIGTERM before stopping Serve."""
        return await self._drain.run(grace_s, self._backend.end_requests)

    async def reload_keys(self) -> str:
        """Re-read the key file now: SIGHUP to `tensorfold serve` or `tensorfold reload-keys` broadcasts it."""
        return self._keys.reload()
