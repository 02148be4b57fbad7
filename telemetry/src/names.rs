//! Every metric duet emits, named and described in one place.
//!
//! Naming: `duet_<subsystem>_<name>_<unit>`; `_total` only on counters; units are `_seconds`
//! and `_bytes` (counts carry no unit suffix). Labels are bounded:
//! - `outcome`: `ok` or the label of duet's one error class (`duet_error_class::ErrorClass`:
//!   `cancelled`, `invalid_argument`, `not_found`, `already_exists`, `resource_exhausted`,
//!   `unauthenticated`, `unavailable`, `deadline_exceeded`, `internal`);
//! - `door`: `grpc` or `http`; `priority`: `interactive` or `batch`;
//! - `placement`: `remote` (disaggregated), `local` (decode worker prefills), `colocated`;
//! - `role`: `prefill` or `decode`; `state`: `ready` or `draining`;
//! - `worker`: the worker id, one value per worker *in this process* (one, except in `duet up`);
//! - `direction`: `sent` or `received`; `reason`: a transfer error class;
//! - `tier`: where a cached KV block lives: `device` (the KV pool), `host`, `disk`;
//! - `from`, `to`: roles of a switch; `source`: `predicted` or `observed`; `decision`:
//!   what a planner evaluation concluded (`keep`, `switch`, `wait`, `no_data`).

/// What kind of metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One entry of the catalogue.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
}

/// Declares each metric once: a `const` with its name (documented by its help text) and an
/// entry in [`CATALOGUE`], from which [`describe_all`](crate::describe_all) describes them.
macro_rules! catalogue {
    ($($kind:ident $konst:ident = $name:literal, $help:literal;)*) => {
        $(
            #[doc = $help]
            pub const $konst: &str = $name;
        )*
        /// Every metric duet emits.
        pub const CATALOGUE: &[Metric] = &[
            $(Metric { name: $name, kind: Kind::$kind, help: $help },)*
        ];
    };
}

catalogue! {
    // ---- router -------------------------------------------------------------------------------
    Counter ROUTER_REQUESTS_TOTAL = "duet_router_requests_total",
        "Finished requests by `door` and `outcome`.";
    Histogram ROUTER_TTFT_SECONDS = "duet_router_time_to_first_token_seconds",
        "Time from arrival to the first token, per request (`door`).";
    Histogram ROUTER_TPOT_SECONDS = "duet_router_time_per_output_token_seconds",
        "Mean time per output token after the first, per request (`door`).";
    Histogram ROUTER_ITL_SECONDS = "duet_router_inter_token_latency_seconds",
        "Time between consecutive tokens as the client sees them (`door`).";
    Histogram ROUTER_E2E_SECONDS = "duet_router_e2e_latency_seconds",
        "Arrival to final message, per request (`door`).";
    Histogram ROUTER_QUEUE_SECONDS = "duet_router_queue_time_seconds",
        "Arrival to the first placement on a worker pair (once per request).";
    Gauge ROUTER_IN_FLIGHT = "duet_router_requests_in_flight",
        "Requests admitted and not finished, by `priority`.";
    Gauge ROUTER_QUEUED = "duet_router_requests_queued",
        "Admitted requests waiting for placement on a worker pair, by `priority`.";
    Counter ROUTER_ROUTING_DECISIONS_TOTAL = "duet_router_routing_decisions_total",
        "Placement decisions by `placement`, one per attempt (a retried request is placed again).";
    Counter ROUTER_RETRIES_TOTAL = "duet_router_retries_total",
        "Attempts re-run on another worker pair after a worker failed before the first token.";
    Counter ROUTER_MIGRATIONS_TOTAL = "duet_router_migrations_total",
        "Streams moved to another worker pair after their decode worker failed mid-stream (prompt plus the tokens already sent prefilled again).";
    Counter ROUTER_PROMPT_TOKENS_TOTAL = "duet_router_prompt_tokens_total",
        "Prompt tokens of admitted requests (after truncation).";
    Counter ROUTER_GENERATION_TOKENS_TOTAL = "duet_router_generation_tokens_total",
        "Tokens streamed to clients.";
    Counter ROUTER_TLS_HANDSHAKE_FAILURES_TOTAL = "duet_router_tls_handshake_failures_total",
        "Connections to the HTTPS door dropped at the TLS handshake (not TLS, untrusted client certificate, timeout).";
    Gauge ROUTER_HTTP_CONNECTIONS = "duet_router_http_connections",
        "Connections open on the HTTP door.";
    Counter ROUTER_HTTP_CONNECTIONS_REFUSED_TOTAL = "duet_router_http_connections_refused_total",
        "Connections to the HTTP door answered 503 and closed at once: `--http-max-connections` were open.";
    Gauge ROUTER_WORKERS = "duet_router_workers",
        "Workers in the router's cluster view, by `role` and `state` (`ready`, `draining`).";
    Counter ROUTER_PREFIX_MATCH_TOKENS_TOTAL = "duet_router_prefix_match_tokens_total",
        "Prompt tokens the worker chosen to prefill was expected to hold in its prefix cache (KV-aware routing), by `placement`.";
    Gauge ROUTER_KV_INDEX_BLOCKS = "duet_router_kv_index_blocks",
        "Cached blocks the router's KV index knows of, over every worker (from their KV events).";
    Counter ROUTER_KV_INDEX_RESYNCS_TOTAL = "duet_router_kv_index_resyncs_total",
        "Times the router subscribed again to a worker's KV events (a gap in the sequence, a broken stream, a worker restart).";

    // ---- prefill worker -----------------------------------------------------------------------
    Counter PREFILL_PROMPT_TOKENS_TOTAL = "duet_prefill_prompt_tokens_total",
        "Prompt tokens computed (`worker`).";
    Counter PREFILL_REQUESTS_TOTAL = "duet_prefill_requests_total",
        "Prompt requests finished (`worker`, `outcome`).";
    Histogram PREFILL_BATCH_TOKENS = "duet_prefill_batch_size_tokens",
        "Tokens in one forward batch (`worker`).";
    Histogram PREFILL_BATCH_SECONDS = "duet_prefill_batch_duration_seconds",
        "Duration of one forward batch (`worker`).";
    Histogram PREFILL_REQUEST_SECONDS = "duet_prefill_request_duration_seconds",
        "Arrival to the decode worker's acknowledgement of the last KV layer, per request (`worker`).";
    Gauge PREFILL_QUEUE_DEPTH = "duet_prefill_queue_depth",
        "Requests waiting or running on the engine (`worker`).";
    Gauge PREFILL_QUEUED_TOKENS = "duet_prefill_queued_tokens",
        "Prompt tokens not yet computed (`worker`).";
    Gauge PREFILL_BUSY_RATIO = "duet_prefill_busy_ratio",
        "Share of the last second the engine computed, 0..1 (`worker`): the CPU stand-in for GPU utilisation.";
    Gauge PREFILL_KV_BLOCKS_USED = "duet_prefill_kv_blocks_used",
        "KV blocks held by prompts being prefilled (`worker`); cached prefix blocks nobody holds are not counted.";
    Gauge PREFILL_KV_BLOCKS_CAPACITY = "duet_prefill_kv_blocks_capacity",
        "KV blocks in the prefill worker's scratch pool (`worker`).";
    Counter PREFILL_FORWARDS_STOPPED_TOTAL = "duet_prefill_forwards_stopped_total",
        "Forward passes stopped between layers because nobody waited for any of their prompts any more (`worker`).";

    // ---- decode worker ------------------------------------------------------------------------
    Gauge DECODE_RUNNING = "duet_decode_running_sequences",
        "Sequences in the running batch (`worker`).";
    Gauge DECODE_WAITING = "duet_decode_waiting_sequences",
        "Sequences admitted to the scheduler but not running yet: queued for room or preempted (`worker`); reservations still waiting for KV are not counted.";
    Histogram DECODE_BATCH_SIZE = "duet_decode_batch_size",
        "Sequences in one engine step (`worker`).";
    Histogram DECODE_STEP_SECONDS = "duet_decode_step_duration_seconds",
        "Duration of one engine step: decode rows and any local prefill chunks (`worker`).";
    Counter DECODE_GENERATED_TOKENS_TOTAL = "duet_decode_generated_tokens_total",
        "Tokens generated (`worker`).";
    Gauge ENGINE_DEVICE_MEMORY_BYTES = "duet_engine_device_memory_bytes",
        "Memory a worker's engine holds on its compute device (`worker`, `device`: cpu or cuda:N, `kind`: weights or kv_pool; on cpu, host memory).";
    Gauge DECODE_KV_BLOCKS_USED = "duet_decode_kv_blocks_used",
        "KV blocks held by sequences or reservations (`worker`).";
    Gauge DECODE_KV_BLOCKS_CAPACITY = "duet_decode_kv_blocks_capacity",
        "KV blocks in the pool (`worker`).";
    Counter DECODE_PREEMPTIONS_TOTAL = "duet_decode_preemptions_total",
        "Sequences preempted (KV freed, recomputed later) (`worker`).";
    Counter DECODE_RESERVATIONS_EXPIRED_TOTAL = "duet_decode_reservations_expired_total",
        "Reservations that expired before their KV arrived (`worker`).";
    Counter DECODE_READ_BYTES_TOTAL = "duet_decode_read_bytes_total",
        "Bytes of weights and KV a step reads, summed over steps (`worker`).";
    Gauge DECODE_BANDWIDTH_BYTES_PER_SECOND = "duet_decode_memory_bandwidth_bytes_per_second",
        "Weights + KV bytes the last engine step read divided by its duration (`worker`): the CPU stand-in for HBM bandwidth.";

    // ---- prefix cache (both workers) ----------------------------------------------------------
    Counter PREFIX_CACHE_QUERIES_TOTAL = "duet_prefix_cache_queries_total",
        "Prompt tokens looked up in a worker's prefix cache (`role`, `worker`); with the hits, the hit rate.";
    Counter PREFIX_CACHE_HITS_TOTAL = "duet_prefix_cache_hits_total",
        "Prompt tokens whose KV came from the prefix cache instead of being computed or transferred, by the `tier` they were found in (`role`, `worker`).";
    Gauge PREFIX_CACHE_BLOCKS = "duet_prefix_cache_blocks",
        "Cached KV blocks a worker holds, by `tier` (`role`, `worker`).";
    Counter PREFIX_CACHE_PREFETCHED_BLOCKS_TOTAL = "duet_prefix_cache_prefetched_blocks_total",
        "Blocks brought up from the host or disk tier into the KV pool ahead of a request the router announced (`role`, `worker`).";

    // ---- kv-transfer --------------------------------------------------------------------------
    Counter KV_TRANSFER_BYTES_TOTAL = "duet_kv_transfer_bytes_total",
        "KV payload bytes by `direction` and `transport` (tcp, shm, local; as stored in the KV pool).";
    Counter KV_TRANSFER_WIRE_BYTES_TOTAL = "duet_kv_transfer_wire_bytes_total",
        "KV payload bytes the transport carried by `direction` and `compression` (below the payload bytes with --kv-compression f16 or int8).";
    Counter KV_TRANSFER_TRANSFERS_TOTAL = "duet_kv_transfer_transfers_total",
        "Completed transfers (one per prompt chunk) by `direction` and `transport` (tcp, shm, local, rdma).";
    Histogram KV_TRANSFER_SECONDS = "duet_kv_transfer_duration_seconds",
        "KV transfer time not hidden behind compute, per request: end of the last forward to the decode worker's acknowledgement of the last layer (sender side).";
    Counter KV_TRANSFER_FAILURES_TOTAL = "duet_kv_transfer_failures_total",
        "Failed transfers by `direction` and `reason`.";
    Counter KV_TRANSFER_SHM_PULLS_TOTAL = "duet_kv_transfer_shm_pulls_total",
        "Layers a decode worker pulled over shm, by `source`: `send_arena` (copied from its mapping of the prefill worker's send arena) or `process_memory` (read with process_vm_readv).";

    // ---- role switching (duet worker, duet planner) -------------------------------------------
    Gauge WORKER_ROLE = "duet_worker_role",
        "1 for the role a switchable worker (`duet worker`) serves now, 0 for the other (`role`, `worker`).";
    Counter WORKER_ROLE_SWITCHES_TOTAL = "duet_worker_role_switches_total",
        "Role switches a worker made (`from`, `to`, `worker`).";
    Histogram WORKER_ROLE_SWITCH_SECONDS = "duet_worker_role_switch_duration_seconds",
        "From a role request to the new role registered: the old role's drain plus the new one's start (`worker`).";
    Counter PLANNER_ROLE_SWITCHES_TOTAL = "duet_planner_role_switches_total",
        "Role switches the planner asked for (`from`, `to`).";
    Gauge PLANNER_ATTAINMENT_RATIO = "duet_planner_attainment_ratio",
        "SLO attainment of the current layout over the planner's window: `source` = `observed` (the routers' requests) or `predicted` (simulated on the profile).";
    Gauge PLANNER_WORKERS = "duet_planner_workers",
        "Workers the planner sees serving each `role`.";
    Counter PLANNER_EVALUATIONS_TOTAL = "duet_planner_evaluations_total",
        "Planner evaluations by `decision`.";

    // ---- registry (discovery) -----------------------------------------------------------------
    Counter LEASE_RENEWALS_TOTAL = "duet_registry_lease_renewals_total",
        "Successful lease renewals.";
    Counter LEASE_FAILURES_TOTAL = "duet_registry_lease_failures_total",
        "Failed lease renewals (timeouts, unreachable registry, lease lost).";
    Counter REGISTRATIONS_TOTAL = "duet_registry_registrations_total",
        "Successful (re-)registrations: a new lease granted and the record put under it.";
    Counter WATCH_RESTARTS_TOTAL = "duet_registry_watch_restarts_total",
        "Times a cluster view dropped its watch and listed again (break, compaction, outage).";
    Gauge VIEW_STALE = "duet_registry_view_stale",
        "1 while a cluster view routes on a view it could not confirm against the registry.";
}
