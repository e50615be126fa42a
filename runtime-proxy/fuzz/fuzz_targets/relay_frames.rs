#![no_main]
//! Bytes from either end of a relayed connection: frame cutting, padding and
//! priority, SETTINGS and WINDOW_UPDATE, header blocks across CONTINUATIONs and
//! the HPACK table they keep.
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tessera_runtime_proxy::http2::frame;
use tessera_runtime_proxy::relay::{HeaderBlocks, Step};

fuzz_target!(|data: &[u8]| {
    let mut input = BytesMut::from(data);
    let mut blocks = HeaderBlocks::requests();
    while let Some((head, bytes)) = frame::next_frame(&mut input) {
        let _ = frame::data_payload(&head, &bytes);
        let _ = frame::window_increment(&bytes);
        for _ in frame::settings(&head, &bytes) {}
        if let Step::Fatal = blocks.read(&head, &bytes, 4096) {
            return;
        }
    }
});
