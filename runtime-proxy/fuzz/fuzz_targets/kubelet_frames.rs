#![no_main]
//! kubelet's side of the connection, through the authority pass: any bytes after
//! the preface, arriving in any pieces, never panic; unless the pass re-encoded a
//! block or failed the connection, h2 is handed exactly what kubelet sent. The
//! same bytes as one HPACK block must decode or fail cleanly.
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tessera_runtime_proxy::{AuthorityNormaliser, HEADER_TABLE_SIZE};
use tessera_runtime_proxy::http2::hpack::Decoder;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, frames)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk).max(1);
    let mut sent = PREFACE.to_vec();
    sent.extend_from_slice(frames);

    let mut normaliser = AuthorityNormaliser::new();
    let mut input = BytesMut::new();
    let mut output = BytesMut::new();
    for piece in sent.chunks(chunk) {
        input.extend_from_slice(piece);
        normaliser.process(&mut input, &mut output);
    }
    normaliser.finish(&mut input, &mut output);
    if !normaliser.is_rewriting() && !normaliser.is_closed() {
        assert_eq!(&output[..], &sent[..]);
    }

    let mut decoder = Decoder::new(HEADER_TABLE_SIZE);
    let _ = decoder.decode(frames, |_, _, _| {});
});
