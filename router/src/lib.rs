//! The router: public gRPC/HTTP doors, validation, routing, admission. Filled by the cluster issue.
