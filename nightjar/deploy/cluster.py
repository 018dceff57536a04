"""Build, start and run the Serve application: ``nightjar serve --replicas N`` lands here."""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass

log = logging.getLogger("nightjar.deploy")

APP_NAME = "nightjar"


@dataclass
class ClusterOptions:
    """Serve's own knobs, by their Serve names. ``min_replicas``/``max_replicas`` switch on Serve's
    autoscaler (on ongoing requests per replica, ``target_ongoing_requests``) instead of ``num_replicas``."""
    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 64
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ray_address: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20

    def check(self) -> None:
        """ValueError (one line) for settings Serve would reject or that cannot work."""
        if self.num_replicas < 1:
            raise ValueError(f"--replicas must be >= 1 (got {self.num_replicas})")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("--min-replicas and --max-replicas go together (autoscaling)")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas >= 1:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1 "
                             f"(got {self.min_replicas}, {self.max_replicas})")
        if self.max_ongoing_requests < 1 or self.target_ongoing_requests <= 0:
            raise ValueError("--max-ongoing-requests must be >= 1 and --target-ongoing-requests > 0")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")

    def replica_config(self) -> dict:
        cfg: dict = {"max_ongoing_requests": self.max_ongoing_requests,
                     "ray_actor_options": {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus}}
        if self.min_replicas is not None:
            cfg["autoscaling_config"] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                         "initial_replicas": max(self.min_replicas, 1),
                                         "target_ongoing_requests": self.target_ongoing_requests}
        else:
            cfg["num_replicas"] = self.num_replicas
        return cfg


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """ConnectionError (one line) when ``host:port`` does not accept a TCP connection; Ray itself would
    retry for minutes. ``auto`` and ``ray://`` addresses are left to Ray."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address must be auto, host:port or ray://host:port (got {address!r})")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address}: {e}") from None


def board_name(app_name: str = APP_NAME) -> str:
    return f"{app_name}-metrics"


def build_app(engine_kwargs: dict, model_name: str, opts: ClusterOptions, app_name: str = APP_NAME):
    """The bound Serve application (ingress -> engine replicas). Needs a running Ray (the metrics board)."""
    from ray import serve

    from nightjar.deploy.serve_app import EngineReplica, Ingress, metrics_board

    metrics_board(board_name(app_name))
    engine = serve.deployment(EngineReplica, name="NightjarEngine", health_check_period_s=2.0,
                              health_check_timeout_s=30.0, **opts.replica_config())
    # the ingress relays bytes: no CPU reserved, enough concurrency for every replica's streams
    ingress = serve.deployment(Ingress, name="NightjarIngress", num_replicas=1,
                               max_ongoing_requests=max(1024, 4 * opts.max_ongoing_requests),
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(engine_kwargs, model_name, board_name(app_name)), opts.api_key,
                        opts.max_body_bytes, board_name(app_name))


def start(engine_kwargs: dict, model_name: str, opts: ClusterOptions, app_name: str = APP_NAME,
          ray_init_kwargs: dict | None = None, route_prefix: str = "/") -> str:
    """Start (or join, with ``opts.ray_address``) Ray, start Serve's HTTP proxy on ``opts.host:port``, deploy
    under ``route_prefix`` and wait until every replica is up. Returns the endpoint URL."""
    import ray
    from ray import serve

    opts.check()
    if not ray.is_initialized():
        check_reachable(opts.ray_address)
        ray.init(address=opts.ray_address, include_dashboard=False, log_to_driver=True,
                 **(ray_init_kwargs or {}))
    serve.start(http_options={"host": opts.host, "port": opts.port})
    serve.run(build_app(engine_kwargs, model_name, opts, app_name), name=app_name, route_prefix=route_prefix)
    return f"http://{opts.host}:{opts.port}{route_prefix.rstrip('/')}"


def serve_cluster(engine_kwargs: dict, opts: ClusterOptions, log_level: str = "info") -> None:
    """``nightjar serve --replicas N``: deploy, then wait for Ctrl+C; shut Serve down when this process
    started Ray."""
    import ray

    from nightjar.kernel.config import EngineConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = dict(engine_kwargs)
    model_name = str(kwargs.pop("served_model_name", None) or kwargs.get("model", EngineConfig().model))
    owned = opts.ray_address is None
    try:
        url = start(kwargs, model_name, opts)
        log.info("serving %s on %s with %s - Ctrl+C to stop", model_name, url,
                 f"{opts.num_replicas} replicas" if opts.min_replicas is None
                 else f"{opts.min_replicas}..{opts.max_replicas} replicas (autoscaling)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:        # also while deploying
        pass
    finally:
        if ray.is_initialized():
            _teardown(owned)


def _teardown(owned: bool) -> None:
    """Remove the app and its metrics board (detached: it would outlive us on a joined cluster); stop Serve
    and Ray when this process started them."""
    import ray
    from ray import serve

    from nightjar.deploy.serve_app import BOARD_NAMESPACE

    for step in (lambda: serve.delete(APP_NAME),
                 lambda: ray.kill(ray.get_actor(board_name(), namespace=BOARD_NAMESPACE))):
        try:
            step()
        except Exception as e:       # best effort on the way out
            log.debug("teardown: %s", e)
    if owned:
        serve.shutdown()
        ray.shutdown()
