//! gRPC contract of duet (package `duet.v1`). Filled by the cluster issue.
