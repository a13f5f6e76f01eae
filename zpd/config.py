"""Frozen configuration records of each process. Addresses and ports are fields,
never constants, so any number of workers share a host without colliding.

These defaults are the only ones. A field that a `zpd` flag sets declares that
flag too (`flag(...)`, zpd/flag.py): its name, SGLang alias, help and --help group;
zpd/ops/flags.py builds the parsers from these fields, so a default changed here
changes the CLI and its --help too."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from engines.formats.overrides import ModelOverrides
from zpd.flag import flag
from zpd.limits import BUSY_POLL_HELP, HEARTBEAT_HELP, PEER_TIMEOUT_HELP, Deadlines, PromptLimits

# Helps that several records' flags share (a worker's and a router's --heartbeat, ...).
CURVE_HELP = ("CURVE key directory made by `zpd keys`: encrypt every connection and admit "
              "only authorised keys (default: plaintext)")
ROUTER_SECRET_HELP = (
    "without --curve-keys: a file (mode 0600, at least 16 bytes) holding the secret the "
    "cluster's routers prove themselves with, the same file for every router and worker "
    "(`zpd launch` makes one; `zpd keys DIR --router-secret` writes DIR/router.secret). Workers then "
    "take requests only from those routers, a decode lets a restarted router adopt its "
    "predecessor's requests, and a coordinator accepts followers; without it requests "
    "stay open to anyone who reaches a worker's port and adopt and follow are refused "
    "(docs/operating.md, Security)")
INSECURE_HELP = ("serve without --curve-keys on a non-loopback --host (anyone who reaches the "
                 "port may send requests and admin commands); refused without this flag")
HTTP_WORKERS_HELP = ("HTTP front processes serving the same host:port (SO_REUSEPORT; "
                     "default {default}): each is a whole front with its own router connections, "
                     "for more than one core of HTTP work. One that dies is restarted; one "
                     "that dies at start-up or within 10 s of its start stops them all")


@dataclass(frozen=True)
class WorkerConfig:
    role: str                        # "prefill" or "decode"
    model: str = flag(
        help="Hugging Face-format directory (Llama, Mistral, Qwen2, Qwen3; mixtures of "
             "experts: Qwen3-MoE, Mixtral, GLM-4.5), a .gguf file, "
             "'smollm2', 'tiny' (embedded default; 'tiny:SEED' for other weights) or "
             "'null[:STEP_MS]' (no model: a simulation, docs/serving.md); --model-path is "
             "SGLang's name for it", group="model", names=("--model", "--model-path"),
        required=True)
    host: str = flag("127.0.0.1", "interface to bind (default {default})", "network")
    # 0: any free port (the bound one is reported)
    port: int = flag(0, "port to bind (default {default}: any free port)", "network", type=int)
    device: str = flag("cpu", "cpu or cuda[:N] (default {default})", "model")
    dtype: str = flag("float32", "weights and KV dtype; float64 keeps near-ties out of "
                      "exactness tests", "model",
                      choices=("float32", "bfloat16", "float16", "float64"))
    weight_version: str | None = flag(None, "version string reported with every token "
                                      "(default: model name)", "model")
    page_size: int = flag(16, "tokens per KV page (default {default})", "memory and batching",
                          type=int)
    # None on the command line when not given, so that giving it with --mem-fraction-static
    # is refused
    kv_cache_mb: float = flag(256, "KV pool size in MiB (default {default})",
                              "memory and batching", type=float, cli_default=None,
                              exclusive="kv pool")
    # SGLang's --mem-fraction-static: weights + KV take this fraction of the device's memory
    # (zpd/worker/mem_fraction.py); None: the KV pool is kv_cache_mb
    mem_fraction_static: float | None = flag(
        None, "instead of --kv-cache-mb (SGLang's flag): weights + KV pool take this fraction "
              "of the device's memory; the pool gets fraction x total memory (GPU; on cpu the "
              "RAM, within the cgroup limit) minus the loaded weights. Each worker takes it: "
              "N workers sharing a device give 1/N each", "memory and batching", type=float,
        exclusive="kv pool")
    overrides: ModelOverrides = field(default_factory=ModelOverrides)  # tokenizer, template, context
    # zero each KV page as it is freed (docs/operating.md, "Security")
    clear_freed_pages: bool = flag(
        False, "zero every KV page when it is freed, so no request's KV outlives it in memory "
               "(Mooncake lets any engine that reaches its port read registered memory; "
               "docs/operating.md, Security); costs a memset per freed page", "security",
        action="store_true")
    # a prefill keeps computed prompt pages for reuse
    prefix_cache: bool = flag(
        True, "do not keep computed prompt pages for reuse (by default a prefill reuses the KV "
              "of a prompt prefix it computed before under the same weights; docs/serving.md, "
              "Prefix cache)", "memory and batching", names=("--no-prefix-cache",),
        action="store_true", cli_default=False)
    # requests may ask for their routed experts (engines/routed.py): a mixture of experts only
    enable_return_routed_experts: bool = flag(
        False, "let requests ask for each position's routed experts (`return_routed_experts` on "
               "/generate, SGLang's flag and shape: meta_info.routed_experts, base64 int32 of "
               "(prompt + output - 1) x layers x experts per token) and their gate weights "
               "(`return_routed_expert_weights`); a mixture-of-experts model only; such requests "
               "take no prefix-cache hit (their prefix is recomputed)", "model",
        action="store_true")
    # batch-invariant kernels and one reduction order per row (docs/deterministic.md)
    deterministic: bool = flag(
        False, "deterministic inference: a request's tokens and logprobs are the same bits "
               "whatever its batch, its prefix-cache hit, a retraction or the thread count, and "
               "a generation's output_token_logprobs equal a scoring pass's input_token_logprobs "
               "(SGLang's --enable-deterministic-inference); CPU backend, --tp 1; costs speed "
               "(docs/deterministic.md)", "model",
        names=("--deterministic", "--enable-deterministic-inference"), action="store_true")
    max_batch: int = flag(64, "most requests decoding at once, counting those whose KV is "
                          "still arriving (default {default})", "memory and batching", type=int)
    max_prefill_tokens: int = flag(8192, "most prompt tokens in one prefill forward (default "
                                   "{default})", "memory and batching", type=int)
    # a prefill step's tokens are also bounded by what this worker computes in this many
    # seconds (measured), so a step does not hold other callers' requests long; 0: off
    prefill_step_seconds: float = flag(
        1.0, "a prefill step also takes at most the tokens this worker computes in this many "
             "seconds (measured as it runs), so that a request from another caller waits "
             "little behind a long batch; a single prompt is still computed in one step (0 = "
             "off; default {default})", "memory and batching", type=float)
    transport: str = flag("mooncake", "KV transfer backend (default {default})", "network",
                          choices=("mooncake",))
    # RDMA device names for Mooncake ("" = auto/TCP)
    ib_device: str = flag("", "RDMA device name(s) for Mooncake, e.g. mlx5_0 ('' = auto; TCP "
                          "without RDMA NICs)", "network")
    protocol: str = flag("tcp", "Mooncake protocol hint (Mooncake picks RDMA when NICs exist; "
                         "MC_FORCE_TCP=1 forces TCP)", "network", choices=("tcp", "rdma"))
    deadlines: Deadlines = field(default_factory=Deadlines)
    ready_file: str | None = flag(None, "write {role, endpoint, pid} here once ready", "network")
    # CURVE key directory (zpd.wire.security); None: plaintext
    curve_keys: str | None = flag(None, CURVE_HELP, "security")
    # without keys, the cluster's routers prove themselves with it (zpd/wire/router_proof.py);
    # None: requests open to anyone, adopt refused
    router_secret_file: str | None = flag(None, ROUTER_SECRET_HELP, "security")
    # update_weights loads only from under here; None: anywhere
    weights_root: str | None = flag(
        None, "update_weights loads checkpoints only from under this directory (relative paths "
              "are taken from it; anything else is 403); default: any path on the worker's "
              "host", "security")
    # a non-loopback host without curve_keys (zpd.ops.exposure)
    insecure: bool = flag(False, INSECURE_HELP, "security", action="store_true")
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    # the most seconds a trainer's join or push may take here; past it the helper receiving
    # it is killed and the old weights stay (zpd/worker/weights/sync.py)
    weight_sync_timeout: float = flag(
        300.0, "seconds a trainer's init_weights_update_group or weight push may take on a "
               "worker before it fails with 504, the old weights kept (default {default}); "
               "`zpd admin cancel-weight-update` ends one sooner", "timeouts", type=float)
    # tensor-parallel ranks (engines/tp/): this process is rank 0
    tp: int = flag(1, "tensor parallelism: the model split over this many processes (attention "
                   "heads and the MLP, Megatron's way; key/value heads replicated when fewer "
                   "than the ranks); gloo on cpu, NCCL on cuda with rank r on cuda:r; --threads "
                   "is shared among them (default {default})", "parallelism",
                   names=("--tp", "--tp-size"), type=int)
    ep: int = flag(1, "expert parallelism for a mixture-of-experts model: its experts "
                   "partitioned over this many processes (rank r holds experts [r*E/N, "
                   "(r+1)*E/N)), each token's rows sent to its experts' ranks by all-to-all; "
                   "1 or equal to --tp (the attention split by heads), or alone (the "
                   "attention whole on every rank) (default {default})", "parallelism",
                   names=("--ep", "--ep-size"), type=int)


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...] = flag(help="prefill endpoints H:P[,H:P...]", group="network",
                                    required=True)
    decode: tuple[str, ...] = flag(help="decode endpoints H:P[,H:P...]", group="network",
                                   required=True)
    host: str = flag("127.0.0.1", "interface to bind (default {default})", "network")
    # the well-known port clients dial; 0: any free port
    port: int = flag(5757, "port to bind (default {default})", "network", type=int)
    admin_timeout_s: float = 30.0
    heartbeat: float = flag(0.5, HEARTBEAT_HELP, "timeouts", type=float)  # ping every worker
    busy_poll_us: float = flag(0.0, BUSY_POLL_HELP, "timeouts", type=float)
    # a worker silent this long is dead until it answers again
    peer_timeout: float = flag(2.0, PEER_TIMEOUT_HELP, "timeouts", type=float)
    ready_file: str | None = flag(None, "write {role, endpoint, pid} here once ready", "network")
    # CURVE key directory (zpd.wire.security); None: plaintext
    curve_keys: str | None = flag(None, CURVE_HELP, "security")
    # the cluster's router secret (zpd/wire/router_proof.py)
    router_secret_file: str | None = flag(None, ROUTER_SECRET_HELP, "security")
    # a non-loopback host without curve_keys (zpd.ops.exposure)
    insecure: bool = flag(False, INSECURE_HELP, "security", action="store_true")
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    # Each client's share (zpd/router/shares.py): past it, its requests wait their turn.
    # The defaults are generous; set from the decodes' KV pool, they keep one client from
    # starving the others (docs/operating.md, "Limits").
    max_client_requests: int = flag(
        1024, "one client's share: requests it may have routed to the workers at once; more "
              "wait in the router's queue, served fairly between clients, then between the "
              "users a client names (the HTTP front names each caller), then between a user's "
              "calls (each HTTP request): fewest routed first (default {default})", "limits",
        type=int)
    max_client_tokens: int = flag(
        1 << 22, "one client's share of KV pages, in tokens: prompt + max_new_tokens summed "
                 "over its routed requests; more wait. A single request needing more is "
                 "refused with 400 (default {default})", "limits", type=int)
    # The waiting room (zpd/router/admission.py): requests routed to the workers at once
    # (0: 64 per decode; sglang-router's name), how many may wait, and how long each may.
    max_concurrent_requests: int = flag(
        0, "requests routed to the workers at once, all clients together; the rest wait in "
           "the router's queue, so the workers' own queues stay short (their "
           "--kv-wait-timeout never fires for load). About the decodes' --max-batch times "
           "their number (default {default}: 64 per decode)", "limits", type=int)
    queue_size: int = flag(
        1 << 14, "requests that may wait in the router's queue. When full, the newest request "
                 "of whoever holds most there (the client, then its user, then its call) is "
                 "refused with 429 'queue full' (Retry-After at the HTTP front): the "
                 "newcomer's own unless it holds less than the others, so one caller alone "
                 "may fill it but not keep others out (default {default})", "limits", type=int)
    queue_timeout: float = flag(
        300.0, "seconds a request may wait in the router's queue (paused or not) before it "
               "ends with 503 'queue timeout' (default {default})", "limits", type=float)
    # another router over the same workers that coordinates pauses and weight pushes; this
    # one follows it (zpd/router/ha/peers.py). None: this one coordinates.
    coordinator: str | None = flag(
        None, "run beside other routers over the same workers: H:P of the router that "
              "coordinates pauses, continues, weight pushes and abort_all across them; this "
              "one follows it, holding its new requests while the pool is paused, and passes "
              "those admin commands on to it. Requests are served either way (default: none, "
              "this router coordinates)", "network")


@dataclass(frozen=True)
class HttpConfig:
    """`zpd http`: an HTTP server that is a client of one router (or several)."""
    # the router's endpoint, or several: "h:p,h:p" (failover.py)
    router: str = flag(
        f"{RouterConfig.host}:{RouterConfig.port}",
        "router endpoint (default {default}), or several routers of one pool, comma-separated: "
        "each front sends its requests to one of them (front i of --workers to router i), "
        "while it is up; when it dies the next ones go to the others and those in flight end "
        "with 503 unless it comes back within 10 s (resumed); admin routes go to the first "
        "router up (docs/http.md, \"Several fronts and routers\")", "network")
    # front processes sharing host:port (ops/http_workers.py)
    workers: int = flag(1, HTTP_WORKERS_HELP, "parallelism", names=("--workers",),
                        dest="http_workers", type=int, metavar="N")
    metrics_dir: str | None = None   # where those fronts sum their latency histograms
    front_index: int | None = None   # which of them this is: its own router (None: random)
    # the cluster's --model: its tokenizer and chat template
    model: str = flag("", "the cluster's --model: its tokenizer and chat template turn token "
                      "ids into text (its weights are not loaded); --model-path is SGLang's "
                      "name", "model", names=("--model", "--model-path"), required=True)
    # the model id clients see (None: `model`)
    served_model_name: str | None = flag(
        None, "the model id /v1/models, OpenAI answers, /get_server_info and the metrics' "
              "model_name report (SGLang's flag; default: --model as given)", "model")
    overrides: ModelOverrides = field(default_factory=ModelOverrides)  # the workers' text overrides
    host: str = flag("127.0.0.1", "interface to serve on, as SGLang's --host (default "
                     "{default})", "network")
    # SGLang's default port; 0: any free port
    port: int = flag(30000, "port, as SGLang's --port (default {default}, SGLang's too; 0 = "
                     "any free port)", "network", type=int)
    # Bearer token every route but /health needs
    api_key: str | None = flag(None, "Bearer token every HTTP route but /health needs "
                               "('Authorization: Bearer KEY'; default $ZPD_API_KEY, else none)",
                               "security")
    # Bearer token the admin routes need (default: api_key)
    admin_api_key: str | None = flag(
        None, "Bearer token the admin routes need (pause, continue, update weights, abort, "
              "memory, flush); without it they take --api-key (default $ZPD_ADMIN_API_KEY)",
        "security")
    # a non-loopback host without api_key (zpd.ops.exposure)
    insecure: bool = flag(False, "serve on a non-loopback --host without --api-key; refused "
                          "without this flag", "security", action="store_true")
    # CURVE key directory; the admin key pair is used
    curve_keys: str | None = flag(None, "the cluster's CURVE key directory (see `zpd keys`): "
                                  "connects to the router with its admin key", "security")
    ready_file: str | None = flag(None, "write {role, endpoint, pid} here once serving",
                                  "network")
    # the router must acknowledge each request within this
    connect_timeout: float = flag(5.0, "seconds within which the router must acknowledge each "
                                  "request, else it fails with 503 (default {default})",
                                  "timeouts", type=float)
    router_silence: float = 10.0     # with requests in flight, a router silent this long is gone
    admin_timeout: float = 30.0      # seconds an admin command may take (update: weights_timeout)
    # seconds a weight update (disk or a trainer's push) may take
    weights_timeout: float = flag(
        600.0, "seconds a weight update may take: update_weights_from_disk, or a trainer's "
               "push from its first broadcast to the commit (a stalled trainer fails the push "
               "after this; default {default})", "timeouts", type=float)
    max_body_bytes: int = 64 << 20   # a request body larger than this is refused (413)
    # Connections and bodies (zpd/http/guard/connections.py, zpd/http/body.py): slow or idle ones are closed.
    keepalive_timeout: float = flag(75.0, "seconds an HTTP connection may stay idle between "
                                    "requests (default {default})", "timeouts", type=float)
    header_timeout: float = flag(10.0, "seconds a request's headers may take from its first "
                                 "byte (default {default})", "timeouts", type=float)
    body_timeout: float = flag(60.0, "seconds a request's body may take to arrive (408 after; "
                               "default {default})", "timeouts", type=float)
    max_connections: int = flag(0, "HTTP connections open at once; past it the one idle "
                                "longest is closed, or the new one refused (default {default}: "
                                "three quarters of the descriptor limit)", "limits", type=int)
    # Host names a keyless front answers (given comma-separated)
    allowed_hosts: tuple[str, ...] = flag(
        (), "without --api-key, the front answers only requests whose Host is an IP address, "
            "localhost, its --host or this machine's name (against DNS rebinding): "
            "comma-separated further names, or '*' for any", "security", cli_default=None)
    # What one call may ask for and how its stream is written (docs/http.md, "Streams"):
    # refused with 400 before anything reaches the router, or aborted when unread.
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)  # the cluster's caps
    max_batch_requests: int = flag(1024, "generations one HTTP call may start (prompts x n); "
                                   "more is refused with 400 (default {default})", "limits",
                                   type=int)
    # SGLang's flag: /generate events carry only news
    incremental_streaming_output: bool = flag(
        False, "each streamed /generate event carries only the text, output_ids and logprobs "
               "new since the last (SGLang's flag); by default each carries everything so "
               "far, as SGLang's", "HTTP", action="store_true")
    # a cumulative /generate stream writes about this many bytes per token: its events spaced
    cumulative_bytes_per_token: int = flag(
        8192, "without --incremental-streaming-output, a streamed /generate's events (each "
              "carrying everything so far) are spaced so that it writes about this many bytes "
              "per token; the last event always comes (default {default})", "HTTP", type=int)
    # a stream its client has not read for this long is aborted
    stream_write_timeout: float = flag(
        10.0, "a stream whose client reads nothing for this many seconds is closed and its "
              "requests aborted (default {default})", "HTTP", type=float)
    # a stream's unsent bytes before its writes wait
    stream_buffer_bytes: int = flag(
        256 << 10, "bytes of a stream the front holds unsent before it waits for the client; "
                   "the socket's kernel send buffer is set to it too (default {default})",
        "HTTP", type=int)
    # all streams' unsent bytes before any stalled one waits
    stream_buffer_total_bytes: int = flag(
        32 << 20, "bytes all streams together may hold unsent: past it, a stream whose client "
                  "is not reading waits until the client takes what it has (else it is closed "
                  "after --stream-write-timeout) before the front holds more of it (default "
                  "{default})", "HTTP", type=int)
    max_call_logprobs: int = flag(
        1 << 20, "prompt logprob entries one call may ask for, summed over its prompts: scored "
                 "positions x (1 + top_logprobs_num + len(token_ids_logprob)), about 30 bytes "
                 "of answer each; more is refused with 400 naming this flag (default "
                 "{default})", "limits", type=int)
    max_answer_bytes: int = flag(
        512 << 20, "bytes a call's answer (not streamed) may hold, about 32 per token id or "
                   "logprob entry; past it the call's requests are aborted and it is answered "
                   "400 naming this flag (default {default})", "limits", type=int)
    # how tool calls are read out of the model's text (zpd/http/tool_parsers.py)
    tool_call_parser: str | None = flag(
        None, "how OpenAI tool calls are written and read (SGLang's names): hermes or qwen25 "
              "(<tool_call>{json}</tool_call>), llama3 (JSON after <|python_tag|>); default: "
              "from the chat template (one that writes <tool_call> is hermes, <|python_tag|> "
              "llama3), else requests with tools are refused", "model",
        choices=("hermes", "qwen25", "llama3"))


@dataclass(frozen=True)
class CommandFlags:
    """Flags that set no record's field as given: how `zpd` starts a process, the text
    overrides it hands the model loader as a ModelOverrides (engines/ has no flags), and
    the files the HTTP keys are read from."""
    config: str | None = flag(
        None, "a TOML file (or YAML, with PyYAML installed) of this command's flags, e.g. "
              "`max-batch = 32`: keys are the flag names (dashes or underscores), values "
              "typed as the flags; flags given on the command line win", "process",
        metavar="FILE")
    log_level: str = flag("WARNING", "DEBUG, INFO (one line per request event), WARNING "
                          "(default), ERROR", "process")
    threads: int | None = flag(None, "torch CPU threads (default: torch's)", "parallelism",
                               type=int)
    tokenizer_path: str | None = flag(
        None, "tokenizer instead of the model's: a tokenizer.json, a directory with one (its "
              "chat template comes along), or a .gguf file; hub names are not fetched, and a "
              "tokenizer larger than the model's vocabulary is refused", "model")
    chat_template: str | None = flag(
        None, "chat template instead of the model's (or the tokenizer's): a Jinja file, or the "
              "template text itself; SGLang's built-in names and JSON templates are refused",
        "model")
    context_length: int | None = flag(
        None, "serve at most this many tokens per request (prompt + max_new_tokens; SGLang's "
              "flag); at most the model's own max_position_embeddings, which is the default",
        "model", type=int)
    api_key_file: str | None = flag(None, "read --api-key from this file (its first line; a "
                                    "key on the command line is readable by every local user)",
                                    "security")
    admin_api_key_file: str | None = flag(
        None, "read --admin-api-key from this file. An admin key needs --curve-keys (or "
              "--insecure): without CURVE any local process can send admin commands to the "
              "router directly", "security")


@dataclass(frozen=True)
class LaunchConfig:
    """`zpd launch`'s own flags: the cluster's shape on this host. The rest of its flags
    are those of the records it starts (WorkerConfig, RouterConfig, HttpConfig)."""
    prefill: int = flag(1, "prefill workers (default {default})", "parallelism", type=int)
    routers: int = flag(
        1, "routers over the workers (default {default}): the first, on --port, coordinates "
           "pauses and weight pushes, the others (on the ports after it) follow it (zpd router "
           "--coordinator); each serves requests, and --max-concurrent-requests 0 splits the "
           'decodes\' batches between them. The ready file gains "routers": [...]',
        "parallelism", type=int)
    decode: int = flag(1, "decode workers (default {default})", "parallelism", type=int)
    prefill_threads: int | None = flag(None, "torch threads of each prefill worker (default: "
                                       "--threads, else a share of the cores, below)",
                                       "parallelism", type=int)
    decode_threads: int | None = flag(None, "torch threads of each decode worker (default: "
                                      "--threads, else a share of the cores, below)",
                                      "parallelism", type=int)
    prefill_tp: int | None = flag(None, "tensor-parallel ranks of each prefill worker (default: "
                                  "--tp); a prefill and a decode of different sizes exchange "
                                  "KV as well", "parallelism", type=int)
    decode_tp: int | None = flag(None, "tensor-parallel ranks of each decode worker (default: "
                                 "--tp)", "parallelism", type=int)
    prefill_ep: int | None = flag(None, "expert-parallel ranks of each prefill worker (default: "
                                  "--ep); the KV does not depend on the experts, so a prefill "
                                  "and a decode of any TP/EP sizes exchange it", "parallelism",
                                  type=int)
    decode_ep: int | None = flag(None, "expert-parallel ranks of each decode worker (default: "
                                 "--ep)", "parallelism", type=int)
    cpu_bind: bool = flag(
        True, "by default the workers without a thread count split this process's CPUs "
              "equally (at least one thread each) and each is bound to its own CPUs while "
              "there are enough; this keeps the split but does not bind", "parallelism",
        names=("--no-cpu-bind",), dest="cpu_bind", action="store_false")
    host: str = flag(RouterConfig.host, "interface for every process (default {default})",
                     "network")
    port: int = flag(RouterConfig.port, "router port (default {default}; 0 = any). SGLang's "
                     "--port is its HTTP port: that is --http-port here", "network", type=int)
    ready_file: str | None = flag(None, 'write {"router": "H:P", "workers": [...]} here once '
                                  "all are ready", "network")
    log_dir: str | None = flag(None, "one log file per process here (default: inherit stderr)",
                               "process")
    startup_timeout: float = flag(180.0, "seconds the workers, routers and HTTP front may each "
                                  "take to be ready (default {default})", "timeouts",
                                  type=float)
    http_port: int | None = flag(None, "also start `zpd http` on this port (0 = any free port); "
                                 'the ready file gains "http": "H:P"', "HTTP", type=int)
    http_workers: int = flag(HttpConfig.workers, HTTP_WORKERS_HELP, "HTTP",
                             names=("--http-workers",), type=int, metavar="N")


@dataclass(frozen=True)
class SlurmConfig:
    """`zpd slurm`'s own flags (scripts/slurm/zpd.sbatch): where the job keeps its files,
    each node's RDMA device, and how its dead steps are started again."""
    job_dir: str | None = flag(None, "the job's directory on the shared filesystem: CURVE keys, "
                               "router secret, ready files, one log per step (default "
                               "SUBMIT_DIR/zpd-JOBID)", "process")
    ib_device_map: str = flag("", "each node's RDMA device(s), 'NODE=DEV[,DEV] NODE=DEV ...' "
                              "(a node not named takes --ib-device)", "network")
    max_restarts: int = flag(3, "times each step (worker, router, HTTP front) is started again "
                             "after it dies, before the job gives it up (default {default})",
                             "process", type=int)
    restart_backoff: float = flag(1.0, "seconds before a dead step's first restart, doubled for "
                                  "each next one (default {default})", "process", type=float)


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of the dataclass `cls`."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")
