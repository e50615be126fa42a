#![no_main]
//! Any bytes, split three ways, must merge or fail cleanly, never panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let a = data.len() / 3;
    let (original, rest) = data.split_at(a);
    let (decoded, updated) = rest.split_at(rest.len() / 2);
    let _ = tessera_runtime_proxy::merge(original, decoded, updated);
    let _ = tessera_runtime_proxy::merge(data, data, &[]);
});
