//! What a worker publishes about its KV cache's layer groups (`duet_engine::KvGroups`), so
//! that a router counts the worker's blocks (`Capacity::blocks_for_tokens`) and matches
//! its cached prefixes (`duet_engine::servable_prefix`) as its cache does.

/// The shape a router needs to count this cache's blocks for a sequence
/// (`Capacity::blocks_for_tokens`): `None` for a cache of one layer group.
pub fn kv_group_shape(
    groups: &duet_engine::KvGroups,
    chunk: usize,
) -> Option<duet_discovery::KvGroupShape> {
    let n = groups.n_groups();
    let local = (0..n).filter(|&g| groups.window(g).is_some()).count();
    let window = (0..n).find_map(|g| groups.window(g))?;
    let u = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
    Some(duet_discovery::KvGroupShape {
        global: u(n - local),
        local: u(local),
        window: u(window),
        chunk: u(chunk),
    })
}

#[cfg(test)]
mod tests {
    use duet_engine::{KvGroups, LayerAttention, LayerSpec};

    use super::kv_group_shape;

    /// The router's count of a sequence's blocks is the engine's admission bound.
    #[test]
    fn the_published_shape_counts_blocks_as_the_cache_admits_them() {
        let layers: Vec<LayerSpec> = (0..18)
            .map(|l| LayerSpec {
                attention: match l % 6 == 5 {
                    true => LayerAttention::Global,
                    false => LayerAttention::Local { window: 512 },
                },
                rope_base: 10_000.0,
            })
            .collect();
        let groups = KvGroups::for_layers(&layers);
        let capacity = duet_discovery::Capacity {
            block_size: 16,
            kv_groups: kv_group_shape(&groups, 256),
            ..Default::default()
        };
        assert!(capacity.kv_groups.is_some());
        for tokens in [1, 100, 511, 512, 513, 777, 4096, 32_768] {
            assert_eq!(
                capacity.blocks_for_tokens(tokens as u64),
                groups.peak_blocks(tokens, 256, 16) as u64,
                "{tokens} tokens"
            );
        }
        assert_eq!(kv_group_shape(&KvGroups::single(30), 256), None);
    }
}
