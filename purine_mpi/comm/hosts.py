"""Which host each rank runs on, and which ranks share one: the table the
ranks exchange at start-up (``HostTable``), from which a location's ``ip``
finds its ranks and a rank its rank on its node. Standard library and
``errors`` only.
"""
import socket

from ..base.errors import UserError


# ------------------------------------------------------------------ host table
def local_host_info():
    """This process's hostname and IPv4 addresses (loopback included)."""
    hostname = socket.gethostname()
    return {"hostname": hostname, "addresses": sorted(_local_addresses(hostname))}


def _local_addresses(hostname):
    addrs = {"127.0.0.1"}
    try:  # every configured interface (Linux ioctl; no extra package)
        import fcntl
        import struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name[:15].encode())
                    res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
                    addrs.add(socket.inet_ntoa(res[20:24]))
                except OSError:
                    pass  # interface without an IPv4 address
        finally:
            s.close()
    except Exception:
        pass
    try:
        addrs.update(socket.gethostbyname_ex(hostname)[2])
    except OSError:
        pass
    return addrs


def _is_loopback(ip):
    return ip.startswith("127.") or ip == "localhost"


class HostTable:
    """Ranks grouped by host; maps {ip, device} locations to ranks.

    ``infos`` is one ``{"hostname", "addresses"}`` dict per rank."""

    def __init__(self, infos):
        self.infos = list(infos)
        self.host_of = []          # rank -> host index
        self.host_ranks = []       # host index -> ranks on it, ascending
        self.host_names = []
        keys = {}
        for r, info in enumerate(self.infos):
            key = (info["hostname"],
                   tuple(a for a in info["addresses"] if not _is_loopback(a)))
            if key not in keys:
                keys[key] = len(self.host_ranks)
                self.host_ranks.append([])
                self.host_names.append(info["hostname"])
            self.host_of.append(keys[key])
            self.host_ranks[keys[key]].append(r)
        self.by_address = {}
        for h, ranks in enumerate(self.host_ranks):
            for a in self.infos[ranks[0]]["addresses"]:
                self.by_address.setdefault(a, set()).add(h)

    @classmethod
    def planned(cls, locations, size=None):
        """A host table for an offline view (``graph --np N``): each distinct
        ip among ``locations``, in order of first appearance, is a host with
        one rank per device it uses; leftover ranks go on a host of their own."""
        hosts = {}
        for loc in locations:
            ip = _get(loc, "ip")
            if ip is None:
                continue
            dev = _get(loc, "device", -1)
            hosts[ip] = max(hosts.get(ip, 1), (dev if dev is not None else -1) + 1)
        infos = []
        for i, (ip, n) in enumerate(hosts.items()):
            infos += [{"hostname": f"host{i}", "addresses": [ip]}] * n
        while size is not None and len(infos) < size:
            infos.append({"hostname": "unplanned", "addresses": []})
        if size is not None and len(infos) > size:
            raise UserError(f"the graph's locations need {len(infos)} ranks "
                            f"({', '.join(f'{ip}: {n}' for ip, n in hosts.items())}), "
                            f"but --np is {size}")
        return cls(infos)

    def local_rank(self, rank):
        return self.host_ranks[self.host_of[rank]].index(rank)

    def rank_of(self, location, what="a node", size=None):
        size = len(self.infos) if size is None else size
        ip = _get(location, "ip")
        if ip is None:
            rank = _get(location, "rank", 0) or 0
            if not 0 <= rank < size:
                raise UserError(f"{what} is placed on rank {rank}, but the job has "
                                f"{size} rank(s) (ranks 0..{size - 1}); start more ranks "
                                "with mpiexec -n or change the location")
            return rank
        hosts = self.by_address.get(ip, set())
        if not hosts and ip in ("localhost",):
            hosts = self.by_address.get("127.0.0.1", set())
        if not hosts:
            known = ", ".join(f"{self.host_names[h]} ({' '.join(self.infos[rs[0]]['addresses'])})"
                              for h, rs in enumerate(self.host_ranks))
            raise UserError(f"{what} is placed on ip {ip}, which is no address of any rank's "
                            f"host (hosts: {known}); use an address of a host in the job, "
                            "or {rank: R} locations")
        if len(hosts) > 1:
            raise UserError(f"{what} is placed on ip {ip}, which names several hosts of the "
                            f"job ({', '.join(self.host_names[h] for h in sorted(hosts))}); "
                            "use a non-loopback address or {rank: R} locations")
        ranks = self.host_ranks[next(iter(hosts))]
        device = _get(location, "device", -1)
        index = max(device if device is not None else -1, 0)
        if index >= len(ranks):
            raise UserError(f"{what} is placed on ip {ip} device {device}, but that host runs "
                            f"only {len(ranks)} rank(s) (one rank per device); start more ranks "
                            "on it")
        return ranks[index]


def _get(loc, key, default=None):
    if isinstance(loc, dict):
        return loc.get(key, default)
    return getattr(loc, key, default)
