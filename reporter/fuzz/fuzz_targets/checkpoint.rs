#![no_main]
//! Any bytes in the checkpoint file: a parse or a clear error, never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(checkpoint) = tessera_reporter::checkpoint::parse_checkpoint(data) {
        for entry in &checkpoint.entries {
            let _ = entry.gpu_ids();
        }
    }
});
