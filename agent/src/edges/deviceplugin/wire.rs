//! The few protobuf messages of the kubelet's device-plugin API (`v1beta1`) and
//! pod-resources API (`v1`) the plugin exchanges, encoded and decoded by hand: field numbers
//! as in the kubelet's `api.proto` files; unknown fields are skipped, as protobuf requires.

use thiserror::Error;

/// A message that is not protobuf.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("malformed protobuf: {0}")]
pub struct Malformed(&'static str);

/// Writes fields in order.
#[derive(Debug, Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn key(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }
    /// A string field (proto3: an empty one is not written).
    pub fn string(&mut self, field: u32, s: &str) -> &mut Self {
        if !s.is_empty() {
            self.bytes(field, s.as_bytes());
        }
        self
    }
    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    /// A bool field (false is not written).
    pub fn bool(&mut self, field: u32, b: bool) -> &mut Self {
        if b {
            self.key(field, 0);
            self.varint(1);
        }
        self
    }
    /// An embedded message (written even when empty: a repeated element counts).
    pub fn message(&mut self, field: u32, f: impl FnOnce(&mut Enc)) -> &mut Self {
        let mut inner = Enc::default();
        f(&mut inner);
        self.bytes(field, &inner.0);
        self
    }
    /// A `map<string, string>` entry.
    pub fn map_entry(&mut self, field: u32, k: &str, v: &str) -> &mut Self {
        self.message(field, |e| {
            e.string(1, k).string(2, v);
        })
    }
}

/// One field as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 2: a string, bytes, an embedded message or a packed repeated field.
    Bytes(&'a [u8]),
    /// Wire types 1 and 5 (skipped by every reader here).
    Fixed,
}

/// Reads fields in order.
#[derive(Debug, Clone)]
pub struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    /// Reads `b`.
    pub fn new(b: &'a [u8]) -> Self {
        Dec(b)
    }
    fn varint(&mut self) -> Result<u64, Malformed> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self.0.split_first().ok_or(Malformed("truncated varint"))?;
            self.0 = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Malformed("varint longer than 10 bytes"))
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if n > self.0.len() {
            return Err(Malformed("field longer than the message"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    /// The next field, or `None` at the end.
    pub fn field(&mut self) -> Result<Option<(u32, Value<'a>)>, Malformed> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = u32::try_from(key >> 3).map_err(|_| Malformed("field number too large"))?;
        let v = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed
            }
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|_| Malformed("length"))?;
                Value::Bytes(self.take(n)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed
            }
            _ => return Err(Malformed("unknown wire type")),
        };
        Ok(Some((field, v)))
    }
}

fn text(b: &[u8]) -> Result<String, Malformed> {
    String::from_utf8(b.to_vec()).map_err(|_| Malformed("string is not UTF-8"))
}

/// `v1beta1.AllocateRequest`: the device ids asked for, per container.
pub fn allocate_request(b: &[u8]) -> Result<Vec<Vec<String>>, Malformed> {
    let mut out = Vec::new();
    let mut d = Dec::new(b);
    while let Some((f, v)) = d.field()? {
        if let (1, Value::Bytes(c)) = (f, v) {
            let mut ids = Vec::new();
            let mut dc = Dec::new(c);
            while let Some((f, v)) = dc.field()? {
                if let (1, Value::Bytes(id)) = (f, v) {
                    ids.push(text(id)?);
                }
            }
            out.push(ids);
        }
    }
    Ok(out)
}

/// What one container gets (`v1beta1.ContainerAllocateResponse`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContainerAllocation {
    /// `envs`.
    pub envs: Vec<(String, String)>,
    /// `mounts`: container path, host path, read-only.
    pub mounts: Vec<(String, String, bool)>,
    /// `cdi_devices`: fully qualified CDI device names.
    pub cdi_devices: Vec<String>,
}

/// `v1beta1.AllocateResponse`.
pub fn allocate_response(containers: &[ContainerAllocation]) -> Vec<u8> {
    let mut e = Enc::default();
    for c in containers {
        e.message(1, |e| {
            for (k, v) in &c.envs {
                e.map_entry(1, k, v);
            }
            for (container, host, ro) in &c.mounts {
                e.message(2, |e| {
                    e.string(1, container).string(2, host).bool(3, *ro);
                });
            }
            for name in &c.cdi_devices {
                e.message(5, |e| {
                    e.string(1, name);
                });
            }
        });
    }
    e.0
}

/// `v1beta1.ListAndWatchResponse`: every device id, healthy.
pub fn list_and_watch_response(ids: &[String]) -> Vec<u8> {
    let mut e = Enc::default();
    for id in ids {
        e.message(1, |e| {
            e.string(1, id).string(2, "Healthy");
        });
    }
    e.0
}

/// `v1beta1.RegisterRequest` (options: no pre-start call, no preferred allocation).
pub fn register_request(endpoint: &str, resource: &str) -> Vec<u8> {
    let mut e = Enc::default();
    e.string(1, "v1beta1")
        .string(2, endpoint)
        .string(3, resource)
        .message(4, |_| {});
    e.0
}

/// One container's devices in `v1.ListPodResourcesResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assigned {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The container.
    pub container: String,
    /// The resource name.
    pub resource: String,
    /// Its device ids.
    pub ids: Vec<String>,
}

/// `v1.ListPodResourcesResponse`: every container's devices of every resource.
pub fn list_pod_resources_response(b: &[u8]) -> Result<Vec<Assigned>, Malformed> {
    let mut out = Vec::new();
    let mut d = Dec::new(b);
    while let Some((f, v)) = d.field()? {
        let (1, Value::Bytes(pod)) = (f, v) else {
            continue;
        };
        let (mut name, mut ns, mut containers) = (String::new(), String::new(), Vec::new());
        let mut dp = Dec::new(pod);
        while let Some((f, v)) = dp.field()? {
            match (f, v) {
                (1, Value::Bytes(b)) => name = text(b)?,
                (2, Value::Bytes(b)) => ns = text(b)?,
                (3, Value::Bytes(b)) => containers.push(b),
                _ => {}
            }
        }
        for c in containers {
            let (mut cname, mut devices) = (String::new(), Vec::new());
            let mut dc = Dec::new(c);
            while let Some((f, v)) = dc.field()? {
                match (f, v) {
                    (1, Value::Bytes(b)) => cname = text(b)?,
                    (2, Value::Bytes(b)) => devices.push(b),
                    _ => {}
                }
            }
            for dev in devices {
                let (mut resource, mut ids) = (String::new(), Vec::new());
                let mut dd = Dec::new(dev);
                while let Some((f, v)) = dd.field()? {
                    match (f, v) {
                        (1, Value::Bytes(b)) => resource = text(b)?,
                        (2, Value::Bytes(b)) => ids.push(text(b)?),
                        _ => {}
                    }
                }
                out.push(Assigned {
                    pod: format!("{ns}/{name}"),
                    container: cname.clone(),
                    resource,
                    ids,
                });
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes as protoc writes them for the same messages (checked by hand against the
    /// encoding rules: key = field << 3 | wire type).
    #[test]
    fn messages_are_encoded_as_protobuf_writes_them() {
        assert_eq!(
            list_and_watch_response(&["a".into()]),
            [0x0a, 0x0c, 0x0a, 0x01, b'a', 0x12, 0x07, b'H', b'e', b'a', b'l', b't', b'h', b'y']
        );
        let r = register_request("x.sock", "r/s");
        assert_eq!(
            &r[..9],
            &[0x0a, 0x07, b'v', b'1', b'b', b'e', b't', b'a', b'1']
        );
        assert!(r.ends_with(&[0x22, 0x00]), "empty options message written");
        let a = allocate_response(&[ContainerAllocation {
            envs: vec![("K".into(), "V".into())],
            mounts: vec![("/c".into(), "/h".into(), true)],
            cdi_devices: vec!["v/c=d".into()],
        }]);
        assert_eq!(
            a,
            [
                0x0a, 0x1d, // container_responses, 29 bytes
                0x0a, 0x06, 0x0a, 0x01, b'K', 0x12, 0x01, b'V', // envs entry
                0x12, 0x0a, 0x0a, 0x02, b'/', b'c', 0x12, 0x02, b'/', b'h', 0x18,
                0x01, // mount
                0x2a, 0x07, 0x0a, 0x05, b'v', b'/', b'c', b'=', b'd', // cdi_devices
            ]
        );
    }

    #[test]
    fn requests_are_read_and_unknown_fields_skipped() {
        // Two containers; the second with two ids; an unknown varint field 7 and a fixed32.
        let mut e = Enc::default();
        e.message(1, |e| {
            e.string(1, "offline-1");
        });
        e.key(7, 0);
        e.varint(300);
        e.key(9, 5);
        e.0.extend_from_slice(&[1, 2, 3, 4]);
        e.message(1, |e| {
            e.string(1, "online-2").string(1, "online-3");
        });
        assert_eq!(
            allocate_request(&e.0).unwrap(),
            vec![
                vec!["offline-1".to_string()],
                vec!["online-2".into(), "online-3".into()]
            ]
        );
        for bad in [
            &[0x0a, 0x05, 0x0a][..],
            &[0x0a][..],
            &[0x0f][..],
            &[0xff; 11][..],
        ] {
            assert!(allocate_request(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn pod_resources_are_read_per_container() {
        let mut e = Enc::default();
        e.message(1, |p| {
            p.string(1, "web").string(2, "team").message(3, |c| {
                c.string(1, "main")
                    .message(2, |d| {
                        d.string(1, "gpu-coloc.dev/shim-online")
                            .string(2, "online-4");
                    })
                    .message(2, |d| {
                        d.string(1, "nvidia.com/gpu").string(2, "GPU-1");
                    });
            });
        });
        let got = list_pod_resources_response(&e.0).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0],
            Assigned {
                pod: "team/web".into(),
                container: "main".into(),
                resource: "gpu-coloc.dev/shim-online".into(),
                ids: vec!["online-4".into()],
            }
        );
    }
}
