//! The prefill worker: batches prompts and streams their KV cache to a decode worker. Filled by the cluster issue.
