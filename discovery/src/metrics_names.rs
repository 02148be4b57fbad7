//! Metric names emitted by this crate, described in one place.
//!
//! This crate only records through the `metrics` facade; installing an exporter is the
//! binary's job, which should call [`describe_metrics`] once at start-up. Labels are bounded:
//! `role` is `prefill` or `decode`.

use metrics::{describe_counter, describe_gauge, Unit};

/// Successful lease renewals.
pub const LEASE_RENEWALS_TOTAL: &str = "duet_registry_lease_renewals_total";
/// Failed lease renewals (timeouts, unreachable registry, lease lost).
pub const LEASE_FAILURES_TOTAL: &str = "duet_registry_lease_failures_total";
/// Successful (re-)registrations: a new lease granted and the record put under it.
pub const REGISTRATIONS_TOTAL: &str = "duet_registry_registrations_total";
/// Times a cluster view dropped its watch and listed again (break, compaction, outage).
pub const WATCH_RESTARTS_TOTAL: &str = "duet_registry_watch_restarts_total";
/// 1 while a cluster view routes on a view it could not confirm against the registry.
pub const VIEW_STALE: &str = "duet_registry_view_stale";
/// Workers in the cluster view, labelled by `role`.
pub const VIEW_WORKERS: &str = "duet_registry_view_workers";

/// Registers descriptions and units for every metric above with the installed recorder.
pub fn describe_metrics() {
    describe_counter!(
        LEASE_RENEWALS_TOTAL,
        Unit::Count,
        "Successful registry lease renewals by this process."
    );
    describe_counter!(
        LEASE_FAILURES_TOTAL,
        Unit::Count,
        "Failed registry lease renewals (timeout, registry unreachable, lease lost)."
    );
    describe_counter!(
        REGISTRATIONS_TOTAL,
        Unit::Count,
        "Worker (re-)registrations: lease granted and record written."
    );
    describe_counter!(
        WATCH_RESTARTS_TOTAL,
        Unit::Count,
        "Cluster view watch restarts (watch broken, history compacted, registry unreachable)."
    );
    describe_gauge!(
        VIEW_STALE,
        Unit::Count,
        "1 while the cluster view cannot confirm its contents against the registry, else 0."
    );
    describe_gauge!(
        VIEW_WORKERS,
        Unit::Count,
        "Workers in the cluster view, by role."
    );
}
