#![no_main]
//! Request bodies from kubelet: framing and every intercepted message type.
use libfuzzer_sys::fuzz_target;
use tessera_runtime_proxy::Method;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = tessera_runtime_proxy::decode_frame(data) {
        for method in Method::ALL {
            let _ = method.decode_request(message);
            let _ = method.decode_response(message);
        }
    }
});
