"""What the benchmark scripts share: free loopback ports, the processes they start (with
their logs, stopped by PID), and CPU time read from /proc and from Redis.

A script imports it with its own directory on the path:

    sys.dont_write_bytecode = True
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchkit
"""
import os, re, shutil, socket, subprocess, sys, tempfile, time

TICK = os.sysconf("SC_CLK_TCK")


def free_port():
    """A port nothing listens on now (bound to 0 and read back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid):
    """CPU seconds a process has used (utime + stime)."""
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def memory_mb(pid):
    """Resident and peak resident memory of a process (VmRSS, VmHWM), in MB."""
    status = open("/proc/%d/status" % pid).read()
    kb = lambda k: int(re.search(r"%s:\s+(\d+) kB" % k, status).group(1))  # noqa: E731
    return kb("VmRSS") / 1024, kb("VmHWM") / 1024


def redis_info(port, section):
    return subprocess.run(["redis-cli", "-p", str(port), "INFO", section], capture_output=True, text=True).stdout


def redis_cpu(port):
    """CPU seconds the redis-server on `port` has used (INFO cpu)."""
    info = redis_info(port, "cpu")
    return sum(float(re.search(r"%s:([\d.]+)" % k, info).group(1)) for k in ("used_cpu_sys", "used_cpu_user"))


def script_calls(port):
    """Script calls (EVAL and EVALSHA) the redis-server on `port` has answered."""
    return sum(int(m) for m in re.findall(r"cmdstat_eval\w*:calls=(\d+)", redis_info(port, "commandstats")))


class Processes:
    """The processes a script starts, each logging to a file in a temporary directory;
    `stop_all` (also on SIGTERM, and from `die`) stops them by PID, last started first."""

    def __init__(self, name):
        self.name = name
        self.tmp = tempfile.mkdtemp(prefix=name + "-")
        self.procs = []
        import signal
        signal.signal(signal.SIGTERM, lambda *a: (self.stop_all(), sys.exit(3)))

    def spawn(self, cmd, name, env=None):
        log = open(os.path.join(self.tmp, name + ".log"), "wb")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        p.log_name = name
        self.procs.append(p)
        return p

    def wait(self, p, *ports):
        """Returns once `p` listens on every port; dies, with its log, if it exits first."""
        for port in ports:
            for _ in range(200):
                if p.poll() is not None:
                    log = open(os.path.join(self.tmp, p.log_name + ".log")).read()
                    self.die("%s exited with %s before listening:\n%s" % (p.log_name, p.returncode, log))
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                self.die("%s: nothing listens on %d" % (p.log_name, port))

    def redis(self, name="redis"):
        """A redis-server of its own, without persistence: its port."""
        port = free_port()
        p = self.spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                        "no"], name)
        self.wait(p, port)
        return port

    def sluice(self, binary, name, config, env=None):
        """`binary serve` on `config` (YAML text; its `server.http` and `server.grpc` may
        be port 0), once both listeners are bound: (process, HTTP "host:port", gRPC port),
        read from its ready file."""
        path, ready = os.path.join(self.tmp, name + ".yaml"), os.path.join(self.tmp, name + ".ready")
        with open(path, "w") as f:
            f.write(config)
        p = self.spawn([binary, "serve", "--config", path, "--ready-file", ready], name, env)
        while not (os.path.exists(ready) and open(ready).read().strip()):
            if p.poll() is not None:
                log = open(os.path.join(self.tmp, name + ".log")).read()
                self.die("%s exited with %s before listening:\n%s" % (name, p.returncode, log))
            time.sleep(0.05)
        text = open(ready).read()
        return p, re.search(r"http=(\S+)", text).group(1), int(re.search(r"grpc=\S+:(\d+)", text).group(1))

    def stop(self):
        """Stops every process started so far (the directory stays)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs.clear()

    def stop_all(self):
        """Stops every process and removes the directory."""
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def die(self, msg):
        print("%s: %s" % (self.name, msg), file=sys.stderr)
        self.stop_all()
        sys.exit(1)
