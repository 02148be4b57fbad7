//! The decode worker: paged KV cache, continuous batching, token streaming. Filled by the cluster issue.
