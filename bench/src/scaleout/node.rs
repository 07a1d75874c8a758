//! The scale-out benchmark's processes: one configuration file per node (a data directory of
//! its own, the shared Qdrant collection and bucket prefix), `ragkv ingest` and `ragkv serve`
//! children of this binary, each optionally pinned to one core with `taskset` (a core stands
//! in for a machine), and the HTTP calls the benchmark makes to them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve::client::{self, Limits};

use crate::Error;

/// What every node shares: the model, the Qdrant collection and the bucket prefix.
#[derive(Debug, Clone)]
pub(crate) struct Cluster {
    pub qdrant_url: String,
    pub collection: String,
    pub s3_url: String,
    pub bucket: String,
    pub region: String,
    pub credentials: String,
    pub prefix: String,
    pub model: Option<PathBuf>,
    pub device: String,
    /// Pin node `i` to core `i % cores` (`None`: no pinning).
    pub cores: Option<usize>,
}

/// One node: its data directory and configuration file.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub name: String,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub core: Option<usize>,
}

fn toml_str(s: &str) -> String {
    Value::String(s.into()).to_string()
}

impl Cluster {
    /// Writes node `i`'s configuration under `work/name` (the data directory inside it).
    pub fn node(&self, work: &Path, name: &str, i: usize) -> Result<Node, Error> {
        let dir = work.join(name);
        std::fs::create_dir_all(&dir).map_err(crate::io(format!("creating {}", dir.display())))?;
        let mut model = format!("[model]\ndevice = {}\n", toml_str(&self.device));
        if let Some(p) = &self.model {
            model += &format!("path = {}\n", toml_str(&p.to_string_lossy()));
        }
        let text = format!(
            "data_dir = {data}\n{model}\n[index]\nurl = {qdrant}\ncollection = {collection}\n\n\
             [remote]\nurl = {s3}\nbucket = {bucket}\nregion = {region}\ncredentials = {cred}\n\
             prefix = {prefix}\nwrite = \"through\"\nread = \"through\"\n\n\
             [serve]\nbind = \"127.0.0.1:0\"\n",
            data = toml_str(&dir.join("data").to_string_lossy()),
            qdrant = toml_str(&self.qdrant_url),
            collection = toml_str(&self.collection),
            s3 = toml_str(&self.s3_url),
            bucket = toml_str(&self.bucket),
            region = toml_str(&self.region),
            cred = toml_str(&self.credentials),
            prefix = toml_str(&self.prefix),
        );
        let config = dir.join("ragkv.toml");
        std::fs::write(&config, text)
            .map_err(crate::io(format!("writing {}", config.display())))?;
        Ok(Node {
            name: name.into(),
            dir,
            config,
            core: self.cores.map(|n| i % n),
        })
    }
}

impl Node {
    /// `ragkv --config <node's> ARGS`, pinned to the node's core; output to files in its
    /// directory (`<what>.out`, `<what>.err`).
    pub fn command(&self, what: &str, args: &[&str]) -> Result<Command, Error> {
        let exe = std::env::current_exe().map_err(crate::io("locating the ragkv binary"))?;
        let mut c = match self.core {
            Some(core) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(core.to_string()).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        c.arg("--config").arg(&self.config).args(args);
        let file = |ext: &str| {
            let p = self.dir.join(format!("{what}.{ext}"));
            std::fs::File::create(&p).map_err(crate::io(format!("creating {}", p.display())))
        };
        c.stdin(Stdio::null())
            .stdout(file("out")?)
            .stderr(file("err")?);
        Ok(c)
    }

    /// The standard output of the command run as `what`.
    pub fn output(&self, what: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{what}.out"))).unwrap_or_default()
    }

    /// The last lines of its standard error, for error messages.
    pub fn errors(&self, what: &str) -> String {
        let t = std::fs::read_to_string(self.dir.join(format!("{what}.err"))).unwrap_or_default();
        let lines: Vec<&str> = t.lines().rev().take(8).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// Starts `ragkv serve` and waits until `server.json` names its address.
    pub fn serve(&self) -> Result<Server, Error> {
        let file = self.dir.join("data").join("server.json");
        let _ = std::fs::remove_file(&file);
        let child = self
            .command("serve", &["serve"])?
            .spawn()
            .map_err(crate::io("starting ragkv serve"))?;
        let mut server = Server { child, addr: None };
        let t = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&file) {
                let addr = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v["url"].as_str()?.strip_prefix("http://")?.parse().ok());
                if let Some(a) = addr {
                    server.addr = Some(a);
                    return Ok(server);
                }
            }
            if let Ok(Some(st)) = server.child.try_wait() {
                return Err(Error::Check(format!(
                    "{}: ragkv serve exited ({st}): {}",
                    self.name,
                    self.errors("serve")
                )));
            }
            if t.elapsed() > Duration::from_secs(300) {
                return Err(Error::Check(format!(
                    "{}: ragkv serve did not start",
                    self.name
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A child process killed (SIGKILL) if still running when dropped: a benchmark that fails
/// half-way leaves no ingest worker behind.
pub(crate) struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A running `ragkv serve`; killed when dropped.
pub(crate) struct Server {
    child: Child,
    addr: Option<SocketAddr>,
}

impl Server {
    pub fn addr(&self) -> SocketAddr {
        self.addr.expect("set once started")
    }

    /// `METHOD path` with an optional JSON body: (status, parsed body or `Null`).
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), Error> {
        let r = client::request_with(self.addr(), method, path, None, body, Limits::WORK)
            .map_err(|e| Error::Check(format!("{method} {path}: {e}")))?;
        Ok((
            r.status,
            serde_json::from_str(&r.body).unwrap_or(Value::Null),
        ))
    }

    /// The sum of the Prometheus samples named `name` (any labels).
    pub fn metric(&self, name: &str) -> Result<f64, Error> {
        let r = client::request_with(self.addr(), "GET", "/metrics", None, None, Limits::WORK)
            .map_err(|e| Error::Check(format!("GET /metrics: {e}")))?;
        Ok(r.body
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum())
    }

    /// Stops the server (SIGTERM, then SIGKILL after 30 s).
    pub fn stop(mut self) {
        terminate(&mut self.child);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn terminate(child: &mut Child) {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return;
    };
    // SAFETY: kill(2) on our own child's pid, which has not been waited for (so not reused).
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}
