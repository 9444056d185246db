"""Scale-out on Ray Serve: the same FastAPI app as `quickdraft serve` (app.create_app), one replica per copy of
the model, each replica with its own LLM and engine thread, behind Ray Serve's HTTP proxy.

Ray Serve does the replicas, the routing (each request to one replica), autoscaling and restarts; quickdraft adds
nothing of its own to that. The ingress is an ASGI app (`_ReplicaASGI`) that hands every request, and the ASGI
lifespan that starts and stops the engine thread, to the app its replica built in its constructor; each response
carries the replica's id in the `x-quickdraft-replica` header.

Three ways in:
- `quickdraft serve --replicas N` (or `--autoscaling-config JSON`): cli.py builds the settings it builds for one
  process and calls `deployment_app` and `serve_forever`;
- `serve run quickdraft.server.ray_serve:build_app model=... replicas=2 ...`: `build_app` is a Ray Serve
  application builder; its arguments are `quickdraft serve`'s options with underscores (see OPTIONS);
- `serve run quickdraft.server.ray_serve:app`: the same with every option from the environment
  (QUICKDRAFT_MODEL, QUICKDRAFT_REPLICAS, ...; QUICKDRAFT_<OPTION> in capitals).

Ray is an optional extra (`pip install 'quickdraft[ray]'`); nothing imports it until a function here needs it.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import sys
import time
from typing import Any, Callable

from quickdraft.cli_args import checked_speculative_config
from quickdraft.errors import QuickdraftError
from quickdraft.server.app import ServerConfig

RAY_MISSING = "Ray is not installed: install quickdraft[ray] (pip install 'quickdraft[ray]') to serve on Ray"
REPLICA_HEADER = "x-quickdraft-replica"
DEPLOYMENT_NAME = "quickdraft"
APP_NAME = "quickdraft"
ENV_PREFIX = "QUICKDRAFT_"


def import_serve():
    """(ray, ray.serve), or a QuickdraftError that says to install the extra."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise QuickdraftError(f"{RAY_MISSING} ({exc})") from None
    return ray, serve


# --- the replica ---------------------------------------------------------------------------------------------
# What this process's replica built: Ray runs each replica in a process of its own, and the ingress app below is a
# copy Ray made when the deployment was defined, which the replica's constructor cannot reach; it finds the
# replica's app here.
_replica: dict[str, Any] = {}


class _ReplicaASGI:
    """The deployment's ingress: forwards each ASGI call (HTTP, and the lifespan that starts the engine thread) to
    this process's replica app, and stamps the replica's id on every response."""

    async def __call__(self, scope, receive, send) -> None:
        app = _replica.get("app")
        if app is None:
            raise RuntimeError("no quickdraft app in this process: the replica's constructor did not run")
        if scope["type"] != "http":
            return await app(scope, receive, send)
        header = (REPLICA_HEADER.encode(), _replica["id"].encode())

        async def send_with_replica(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await app(scope, receive, send_with_replica)


class QuickdraftReplica:
    """One replica: its own LLM (loaded here) and the FastAPI app over it. The engine thread starts and stops
    with the app's lifespan, which Ray Serve runs after this constructor and when the replica shuts down."""

    def __init__(self, llm_kwargs: dict[str, Any], server_config: ServerConfig):
        from quickdraft.offline import load_llm  # quiet, loaded, its objects frozen: a batch actor's load too
        from quickdraft.server.app import create_app

        self.quickdraft_app = create_app(load_llm(llm_kwargs), server_config)
        _replica["app"] = self.quickdraft_app
        _replica["id"] = _replica_id()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted (a draining one is not)."""
        state = self.quickdraft_app.state.server
        if not state.draining and not state.engine.alive:
            raise RuntimeError("the quickdraft engine thread has stopped")


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_tag)
    except Exception:  # outside a replica (a test building it directly)
        return f"pid-{os.getpid()}"


_deployment_cache: list[Any] = []


def replica_deployment():
    """The Ray Serve deployment (defined once per process: defining it imports ray)."""
    if not _deployment_cache:
        _, serve = import_serve()
        ingress = serve.ingress(_ReplicaASGI())(QuickdraftReplica)
        _deployment_cache.append(serve.deployment(name=DEPLOYMENT_NAME)(ingress))
    return _deployment_cache[0]


# --- the application ----------------------------------------------------------------------------------------
def deployment_app(llm_kwargs: dict[str, Any], server_config: ServerConfig, num_replicas: int | None = None,
                   autoscaling_config: dict[str, Any] | None = None, ray_actor_options: dict[str, Any] | None = None,
                   log_level: str | None = None, **deployment_options: Any):
    """The Ray Serve application: `num_replicas` fixed replicas (default 1), or Ray Serve's `autoscaling_config`
    passed through as given (with num_replicas too, it is the autoscaler's initial_replicas unless the config
    sets one). Each replica holds LLM(**llm_kwargs) and the app over it. `ray_actor_options` default to one CPU,
    and one GPU when the model runs on CUDA; a replica takes up to --max-num-seqs requests at once (Ray Serve's
    max_ongoing_requests; beyond, requests wait in Ray Serve's queue); the drain's grace period is Ray Serve's
    graceful_shutdown_timeout_s; `log_level` (info, warning, ...) is the replicas' (Ray Serve's logging_config).
    Other `deployment_options` go to Deployment.options as they are."""
    if "model" not in llm_kwargs:
        raise QuickdraftError("llm_kwargs needs 'model'")
    if num_replicas is not None and not (isinstance(num_replicas, int) and not isinstance(num_replicas, bool)
                                         and num_replicas >= 1):
        raise QuickdraftError(f"--replicas must be an integer >= 1, got {num_replicas!r}")
    if autoscaling_config is not None and not isinstance(autoscaling_config, dict):
        raise QuickdraftError(f"--autoscaling-config must be a JSON object, got {autoscaling_config!r}")
    _, serve = import_serve()
    deployment = replica_deployment()
    options: dict[str, Any] = {"ray_actor_options": ray_actor_options or _default_actor_options(llm_kwargs),
                               "graceful_shutdown_timeout_s": server_config.drain_grace_s}
    if autoscaling_config is not None:
        autoscaling = dict(autoscaling_config)
        if num_replicas is not None:
            autoscaling.setdefault("initial_replicas", num_replicas)
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = num_replicas or 1
    accepted = inspect.signature(serve.deployment).parameters
    per_replica = llm_kwargs.get("max_num_seqs") or 64
    # the name since Ray 2.10; max_concurrent_queries before it
    options["max_ongoing_requests" if "max_ongoing_requests" in accepted else "max_concurrent_queries"] = per_replica
    if log_level is not None and "logging_config" in accepted:
        options["logging_config"] = {"log_level": log_level.upper()}
    options.update(deployment_options)
    try:
        return deployment.options(**options).bind(dict(llm_kwargs), server_config)
    except (ValueError, TypeError) as exc:  # Ray's own checks of the options (pydantic's included)
        what = "--autoscaling-config" if autoscaling_config is not None else "the deployment options"
        raise QuickdraftError(f"{what}: Ray Serve refused it: {exc}") from None


def _default_actor_options(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    device = str(llm_kwargs.get("device", "auto"))
    on_gpu = device.startswith("cuda")
    if device == "auto":
        import torch

        on_gpu = torch.cuda.is_available()
    return {"num_cpus": 1, "num_gpus": 1} if on_gpu else {"num_cpus": 1}


# --- `serve run` arguments ----------------------------------------------------------------------------------
def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _memory(value: Any) -> int | float:
    """Bytes (an integer) or a fraction of the memory available after loading (a number with a point)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    return float(text) if "." in text else int(text)


def _json_object(value: Any) -> dict[str, Any]:
    data = json.loads(value) if isinstance(value, str) else value
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {value!r}")
    return data


def _str(value: Any) -> str:
    return str(value)


# `quickdraft serve`'s options (underscores for dashes), their types and defaults; replicas may be given as
# num_replicas. kv_cache_memory here is bytes or a fraction (no units).
OPTIONS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "model": (_str, None), "draft": (_str, "ngram"), "k": (_int, 5), "fixed_k": (_bool, False),
    "dtype": (_str, "auto"), "device": (_str, "auto"), "runner": (_str, "auto"), "trust_remote_code": (_bool, False),
    "max_num_seqs": (_int, 64), "max_queue": (_int, 256), "kv_cache_memory": (_memory, None),
    "max_model_len": (_int, None), "served_model_name": (_str, None), "api_key": (_str, None),
    "grace_period": (_number, 30.0), "replicas": (_int, None), "autoscaling_config": (_json_object, None),
    "num_cpus": (_number, None), "num_gpus": (_number, None), "tree": (_str, None),
}


def read_options(args: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Every option: from `args` (a `serve run` builder's), else from QUICKDRAFT_<OPTION>, else its default."""
    environ = os.environ if environ is None else environ
    given = {}
    for key, value in (args or {}).items():
        name = str(key).replace("-", "_")
        name = "replicas" if name == "num_replicas" else name
        if name not in OPTIONS:
            raise QuickdraftError(f"unknown option {key!r} for quickdraft on Ray Serve; the options are: "
                                  f"{', '.join(OPTIONS)}")
        given[name] = value
    options = {}
    for name, (convert, default) in OPTIONS.items():
        env_name = ENV_PREFIX + name.upper()
        if name in given:
            value, source = given[name], name
        elif environ.get(env_name) not in (None, ""):
            value, source = environ[env_name], env_name
        else:
            options[name] = default
            continue
        if value is None:
            options[name] = default
            continue
        try:
            options[name] = convert(value)
        except (ValueError, TypeError) as exc:
            raise QuickdraftError(f"{source}={value!r}: {exc}") from None
    return options


def app_settings(args: dict[str, Any] | None = None,
                 environ: dict[str, str] | None = None) -> tuple[dict[str, Any], ServerConfig, dict[str, Any]]:
    """(LLM keyword arguments, ServerConfig, deployment_app's keyword arguments) from `serve run` arguments and
    the environment, checked as `quickdraft serve` checks its options, before any loading."""
    from quickdraft.models.loader import DEFAULT_MODEL

    o = read_options(args, environ)
    if o["max_queue"] < 1:
        raise QuickdraftError(f"max_queue must be >= 1, got {o['max_queue']}")
    if not o["grace_period"] >= 0:
        raise QuickdraftError(f"grace_period must be >= 0 seconds, got {o['grace_period']}")
    if o["replicas"] is not None and o["replicas"] < 1:
        raise QuickdraftError(f"replicas must be >= 1, got {o['replicas']}")
    spec = checked_speculative_config(o["draft"], o["k"], adaptive=not o["fixed_k"], tree=o["tree"])
    model = o["model"] or DEFAULT_MODEL
    llm_kwargs = dict(model=model, speculative_config=spec, dtype=o["dtype"], device=o["device"],
                      trust_remote_code=o["trust_remote_code"], runner=o["runner"], max_num_seqs=o["max_num_seqs"],
                      kv_cache_memory=o["kv_cache_memory"], max_model_len=o["max_model_len"])
    config = ServerConfig(served_model_name=o["served_model_name"] or model, api_key=o["api_key"] or None,
                          max_queue=o["max_queue"], drain_grace_s=o["grace_period"])
    actor_options = None
    if o["num_cpus"] is not None or o["num_gpus"] is not None:
        actor_options = _default_actor_options(llm_kwargs)
        actor_options.update({k: o[k] for k in ("num_cpus", "num_gpus") if o[k] is not None})
    deploy = dict(num_replicas=o["replicas"], autoscaling_config=o["autoscaling_config"],
                  ray_actor_options=actor_options)
    return llm_kwargs, config, deploy


def build_app(args: dict[str, Any]):
    """Ray Serve's application builder: `serve run quickdraft.server.ray_serve:build_app model=M replicas=2 ...`
    (or a config file's `args:`)."""
    llm_kwargs, config, deploy = app_settings(args)
    return deployment_app(llm_kwargs, config, **deploy)


def __getattr__(name: str):
    """`app`: the application with every option from the environment (built when first asked for, so that
    importing this module reads nothing and imports no Ray)."""
    if name == "app":
        return build_app({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- `quickdraft serve --replicas N` ------------------------------------------------------------------------
# Ray Serve's controller gives a new proxy RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s) to answer its ready check and
# kills it after three misses. On a loaded machine a new worker takes longer than that to start and import Ray Serve,
# so the proxy was killed before it ran and serve.start failed. A controller started here gives it as long as
# start_serve waits for it (the environment's value wins).
PROXY_START_S = 600.0
_READY_CHECK_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"


def start_serve(host: str = "127.0.0.1", port: int = 8000) -> None:
    """serve.start with Ray Serve's HTTP proxy on host:port, returning once the proxy is ready, however long a busy
    machine takes to start it (serve.start's own wait gives up after a fixed 60 s while the controller goes on)."""
    ray, serve = import_serve()
    from ray.serve.schema import ProxyStatus

    ready_check_s = os.environ.get(_READY_CHECK_ENV) or str(PROXY_START_S)
    options: dict[str, Any] = {"http_options": {"host": host, "port": port}}
    if "controller_options" in inspect.signature(serve.start).parameters:  # not in older Rays
        options["controller_options"] = {"runtime_env": {"env_vars": {_READY_CHECK_ENV: ready_check_s}}}
    try:
        serve.start(**options)
    except (TimeoutError, ray.exceptions.RayActorError):
        pass  # serve.start's wait is over, or the proxy it waited on was replaced: the controller starts one
    deadline = time.monotonic() + PROXY_START_S
    while not all(status == ProxyStatus.HEALTHY for status in serve.status().proxies.values()):
        if time.monotonic() > deadline:
            raise QuickdraftError(f"Ray Serve's HTTP proxy on {host}:{port} did not start within {PROXY_START_S:g} s "
                                  "(see the proxy's log among Ray Serve's logs)")
        time.sleep(0.5)


def _delete_when_drained(serve, name: str) -> None:
    """serve.delete(name), returning once the application is gone, however long its replicas' drain takes (the
    controller stops a replica at its graceful_shutdown_timeout_s at the latest; serve.delete's own wait gives up
    after a fixed 60 s)."""
    try:
        serve.delete(name)
    except TimeoutError:
        while name in serve.status().applications:
            time.sleep(0.5)


class _Signal(Exception):
    """SIGTERM or SIGINT, raised in the main thread wherever it is waiting."""


def _raise_signal(*_) -> None:
    raise _Signal


def serve_forever(application, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME) -> None:
    """Run `application` on Ray Serve's HTTP proxy at host:port until SIGTERM or SIGINT, then drain: the application
    is deleted first, which Ray Serve does replica by replica once each one's in-flight requests (a stream to its
    last chunk) have finished, for at most the deployment's graceful_shutdown_timeout_s (--grace-period); only then
    is Ray Serve shut down, with the proxy that carries those streams to their clients (shutting it down first cut
    them). While it drains, new requests get Ray Serve's 404 (the route is gone). A signal while starting drains
    the replicas that already serve; a second signal stops at once.

    Connects to the Ray cluster at RAY_ADDRESS when set (and then removes only this application on exit), else (or
    with RAY_ADDRESS=local) starts a local one (and shuts it down on exit)."""
    ray, serve = import_serve()
    local = os.environ.get("RAY_ADDRESS") in (None, "", "local")
    if not ray.is_initialized():
        ray.init()
    # after ray.init, which installs a SIGTERM handler of its own in this process
    previous = {sig: signal.signal(sig, _raise_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    deleting = False
    try:
        try:
            start_serve(host, port)
            serve.run(application, name=name, route_prefix="/")
            print(f"[quickdraft] serving on http://{host}:{port} through Ray Serve (application '{name}'); "
                  "SIGTERM or Ctrl-C stops it", file=sys.stderr)
            while True:
                time.sleep(3600)
        except _Signal:
            pass
        print("[quickdraft] stopping: in-flight requests finish within the grace period (a second signal stops at "
              "once)", file=sys.stderr)
        deleting = True
        _delete_when_drained(serve, name)
    except _Signal:
        print("[quickdraft] stopping now", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if local:
            serve.shutdown()
            ray.shutdown()
        elif not deleting:
            _delete_when_drained(serve, name)


__all__ = ["OPTIONS", "REPLICA_HEADER", "QuickdraftReplica", "app_settings", "build_app", "deployment_app",
           "import_serve", "read_options", "replica_deployment", "serve_forever", "start_serve"]
