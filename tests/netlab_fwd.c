/* One emulated access link of tests/netlab.py: a user-space forwarder between two TUN devices.
 *
 *   netlab_fwd STATS NS_A TUN_A NS_B TUN_B DEFAULT_DELAY_US JITTER_US SEED [DST_IP DELAY_US]...
 *
 * TUN_A lives in namespace NS_A (the node's side: its host or its NAT router), TUN_B in NS_B (the
 * core router). Packets read from TUN_A (what the node sends) are held for the one-way delay of
 * their destination (DST_IP DELAY_US pairs; DEFAULT_DELAY_US for any other), plus a jitter drawn
 * uniformly from [0, JITTER_US], then written into TUN_B. Packets read from TUN_B (what the node
 * receives) are written into TUN_A at once: each direction's delay is applied by its sender's link,
 * so a pair's path i -> j carries exactly delay[i][j]. Release times never go backwards within one
 * destination's queue (jitter does not reorder a flow, unlike netem's default). The rate is not
 * applied here: tc tbf on the two TUN devices limits it (the kernel queues, this process only
 * reads what tbf releases).
 *
 * netem is not in the kernel this was written for; this is its delay part. Compiled by netlab.py
 * with gcc at first use (a Python forwarder tops out far below 1 Gbps: see docs/P2P.md).
 *
 * Once a second it rewrites STATS (JSON): per destination (and "other"), packets, bytes and TCP SYNs
 * (connection attempts: dials) sent, and the packets and bytes received. SIGTERM ends it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEST 128
#define PKT_MAX 65536

struct packet {
    struct packet *next;
    uint64_t release_ns;
    int len;
    unsigned char data[];
};

struct queue {
    uint32_t ip;          /* network order; 0 for "other" */
    uint64_t delay_ns;
    uint64_t last_release_ns;
    struct packet *head, *tail;
    uint64_t packets, bytes, syns, held;
};

static struct queue queues[MAX_DEST + 1];
static int nqueues;
static uint64_t rx_packets, rx_bytes, write_errors;
static volatile sig_atomic_t stop;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int open_tun(const char *ns, const char *name) {
    char path[256];
    snprintf(path, sizeof path, "/run/netns/%s", ns);
    int nsfd = open(path, O_RDONLY | O_CLOEXEC);
    if (nsfd < 0 || setns(nsfd, CLONE_NEWNET) != 0) {
        fprintf(stderr, "netlab_fwd: cannot enter namespace %s: %s\n", ns, strerror(errno));
        exit(2);
    }
    close(nsfd);
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "netlab_fwd: /dev/net/tun: %s\n", strerror(errno));
        exit(2);
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) != 0) {
        fprintf(stderr, "netlab_fwd: TUNSETIFF %s in %s: %s\n", name, ns, strerror(errno));
        exit(2);
    }
    return fd;
}

static struct queue *queue_for(const unsigned char *pkt, int len) {
    if (len >= 20 && (pkt[0] >> 4) == 4) {
        uint32_t dst;
        memcpy(&dst, pkt + 16, 4);
        for (int i = 0; i < nqueues; i++)
            if (queues[i].ip == dst) return &queues[i];
    }
    return &queues[nqueues]; /* "other" */
}

static int is_syn(const unsigned char *pkt, int len) {
    if (len < 20 || (pkt[0] >> 4) != 4 || pkt[9] != 6) return 0;
    int ihl = (pkt[0] & 0x0f) * 4;
    if (len < ihl + 14) return 0;
    unsigned char flags = pkt[ihl + 13];
    return (flags & 0x02) && !(flags & 0x10);
}

static void write_stats(const char *path) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "{\"sent\": {");
    for (int i = 0; i <= nqueues; i++) {
        char ip[INET_ADDRSTRLEN] = "other";
        if (i < nqueues) inet_ntop(AF_INET, &queues[i].ip, ip, sizeof ip);
        fprintf(f, "%s\"%s\": {\"packets\": %llu, \"bytes\": %llu, \"syns\": %llu, \"held\": %llu}",
                i ? ", " : "", ip, (unsigned long long)queues[i].packets, (unsigned long long)queues[i].bytes,
                (unsigned long long)queues[i].syns, (unsigned long long)queues[i].held);
    }
    fprintf(f, "}, \"received\": {\"packets\": %llu, \"bytes\": %llu}, \"write_errors\": %llu}\n",
            (unsigned long long)rx_packets, (unsigned long long)rx_bytes, (unsigned long long)write_errors);
    fclose(f);
    rename(tmp, path);
}

static void on_term(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    if (argc < 9 || (argc - 9) % 2 != 0) {
        fprintf(stderr, "usage: %s STATS NS_A TUN_A NS_B TUN_B DEFAULT_DELAY_US JITTER_US SEED [DST_IP DELAY_US]...\n",
                argv[0]);
        return 2;
    }
    const char *stats = argv[1];
    int a = open_tun(argv[2], argv[3]);
    int b = open_tun(argv[4], argv[5]);
    uint64_t jitter_ns = strtoull(argv[7], NULL, 10) * 1000ull;
    srand48(strtol(argv[8], NULL, 10));
    for (int i = 9; i + 1 < argc && nqueues < MAX_DEST; i += 2) {
        if (inet_pton(AF_INET, argv[i], &queues[nqueues].ip) != 1) {
            fprintf(stderr, "netlab_fwd: bad address %s\n", argv[i]);
            return 2;
        }
        queues[nqueues++].delay_ns = strtoull(argv[i + 1], NULL, 10) * 1000ull;
    }
    queues[nqueues].delay_ns = strtoull(argv[6], NULL, 10) * 1000ull;
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    printf("ready\n");
    fflush(stdout);

    static unsigned char buf[PKT_MAX];
    uint64_t next_stats = now_ns();
    while (!stop) {
        uint64_t now = now_ns();
        uint64_t wake = next_stats;
        for (int i = 0; i <= nqueues; i++)
            if (queues[i].head && queues[i].head->release_ns < wake) wake = queues[i].head->release_ns;
        struct timespec ts = {0, 0};
        if (wake > now) {
            ts.tv_sec = (wake - now) / 1000000000ull;
            ts.tv_nsec = (wake - now) % 1000000000ull;
        }
        struct pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
        int ready = ppoll(fds, 2, &ts, NULL);
        if (ready < 0 && errno != EINTR) break;
        now = now_ns();
        if (ready > 0 && (fds[0].revents & POLLIN)) {
            for (int n = 0; n < 256; n++) {
                int len = read(a, buf, sizeof buf);
                if (len <= 0) break;
                struct queue *q = queue_for(buf, len);
                struct packet *p = malloc(sizeof *p + len);
                if (!p) break;
                memcpy(p->data, buf, len);
                p->len = len;
                p->next = NULL;
                uint64_t release = now + q->delay_ns + (jitter_ns ? (uint64_t)(drand48() * jitter_ns) : 0);
                if (release < q->last_release_ns) release = q->last_release_ns;
                q->last_release_ns = p->release_ns = release;
                if (q->tail) q->tail->next = p; else q->head = p;
                q->tail = p;
                q->packets++;
                q->bytes += len;
                q->held++;
                q->syns += is_syn(buf, len);
            }
        }
        if (ready > 0 && (fds[1].revents & POLLIN)) {
            for (int n = 0; n < 256; n++) {
                int len = read(b, buf, sizeof buf);
                if (len <= 0) break;
                rx_packets++;
                rx_bytes += len;
                if (write(a, buf, len) != len) write_errors++;
            }
        }
        now = now_ns();
        for (int i = 0; i <= nqueues; i++) {
            struct queue *q = &queues[i];
            while (q->head && q->head->release_ns <= now) {
                struct packet *p = q->head;
                q->head = p->next;
                if (!q->head) q->tail = NULL;
                if (write(b, p->data, p->len) != p->len) write_errors++;
                q->held--;
                free(p);
            }
        }
        if (now >= next_stats) {
            write_stats(stats);
            next_stats = now + 1000000000ull;
        }
    }
    write_stats(stats);
    return 0;
}
