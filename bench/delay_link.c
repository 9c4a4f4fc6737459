/* A link that holds every IP packet for a fixed one-way delay, in both directions, between two
 * TUN devices: one in the namespace this program starts in, one in another network namespace.
 *
 *     root namespace --tun NEAR--> [held DELAY_US] --tun FAR--> far namespace
 *     root namespace <--tun NEAR-- [held DELAY_US] <--tun FAR-- far namespace
 *
 * It stands in for `tc qdisc ... netem delay`, which this kernel lacks: a round trip through the
 * link takes 2 * DELAY_US plus the kernel's own time. Packets keep their order and are never
 * reordered or dropped, unless more than SLOTS packets are in flight one way (then the newest is
 * dropped, as a full queue would, and counted). One thread, one ppoll: a packet leaves within
 * microseconds of its due time while the machine has a core free.
 *
 * The TUN devices exist while this program runs. It prints "ready" once both are open, so the
 * caller can configure addresses and routes; on SIGTERM or SIGINT it prints its counts and exits.
 *
 *     delay_link NEAR_NAME FAR_NETNS_PATH FAR_NAME DELAY_US
 *
 * Built by bench/latency.py with `gcc -O2`; Linux only (TUN, setns).
 */
#define _GNU_SOURCE
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

#define SLOTS 32768 /* packets in flight per direction: far more than 1 s of this bench's traffic */
#define PACKET_MAX 2048 /* the devices keep the default MTU of 1500 */

struct held {
    int64_t due_ns;
    uint16_t len;
};

/* One direction: a ring of packets in arrival order, so the head is always the next one due. */
struct lane {
    int in_fd, out_fd;
    struct held *meta;
    unsigned char *data;
    size_t head, count;
    uint64_t forwarded, dropped, write_errors;
};

static volatile sig_atomic_t stopping = 0;

static void on_signal(int sig) {
    (void)sig;
    stopping = 1;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int open_tun(const char *name) {
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        perror("open /dev/net/tun");
        exit(1);
    }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) {
        fprintf(stderr, "TUNSETIFF %s: %s\n", name, strerror(errno));
        exit(1);
    }
    return fd;
}

static void enter_netns(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) {
        fprintf(stderr, "enter network namespace %s: %s\n", path, strerror(errno));
        exit(1);
    }
    close(fd);
}

static void lane_init(struct lane *l, int in_fd, int out_fd) {
    memset(l, 0, sizeof *l);
    l->in_fd = in_fd;
    l->out_fd = out_fd;
    l->meta = calloc(SLOTS, sizeof *l->meta);
    l->data = malloc((size_t)SLOTS * PACKET_MAX);
    if (!l->meta || !l->data) {
        fputs("out of memory\n", stderr);
        exit(1);
    }
}

/* Read every packet waiting on the lane's input and stamp it with its due time. */
static void lane_take(struct lane *l, int64_t delay_ns) {
    unsigned char scratch[PACKET_MAX];
    for (;;) {
        unsigned char *dst = scratch;
        size_t slot = 0;
        if (l->count < SLOTS) {
            slot = (l->head + l->count) % SLOTS;
            dst = l->data + slot * PACKET_MAX;
        }
        ssize_t n = read(l->in_fd, dst, PACKET_MAX);
        if (n <= 0)
            return; /* EAGAIN: drained */
        if (dst == scratch) {
            l->dropped++;
            continue;
        }
        l->meta[slot].due_ns = now_ns() + delay_ns;
        l->meta[slot].len = (uint16_t)n;
        l->count++;
    }
}

/* Write out every packet whose time has come; return ns until the next one (-1: none held). */
static int64_t lane_release(struct lane *l) {
    int64_t now = now_ns();
    while (l->count > 0) {
        struct held *h = &l->meta[l->head];
        if (h->due_ns > now)
            return h->due_ns - now;
        if (write(l->out_fd, l->data + l->head * PACKET_MAX, h->len) == h->len)
            l->forwarded++;
        else
            l->write_errors++;
        l->head = (l->head + 1) % SLOTS;
        l->count--;
    }
    return -1;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fputs("usage: delay_link NEAR_NAME FAR_NETNS_PATH FAR_NAME DELAY_US\n", stderr);
        return 2;
    }
    int64_t delay_ns = atoll(argv[4]) * 1000;
    int near = open_tun(argv[1]);
    enter_netns(argv[2]);
    int far = open_tun(argv[3]);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    struct lane out, back;
    lane_init(&out, near, far);
    lane_init(&back, far, near);
    puts("ready");
    fflush(stdout);

    struct pollfd fds[2] = {{.fd = near, .events = POLLIN}, {.fd = far, .events = POLLIN}};
    while (!stopping) {
        int64_t wait_out = lane_release(&out);
        int64_t wait_back = lane_release(&back);
        int64_t wait = wait_out < 0 ? wait_back
                       : wait_back < 0 ? wait_out
                       : (wait_out < wait_back ? wait_out : wait_back);
        if (wait < 0)
            wait = 100000000; /* nothing held: wake at least every 100 ms to see a signal */
        struct timespec ts = {.tv_sec = wait / 1000000000, .tv_nsec = wait % 1000000000};
        if (ppoll(fds, 2, &ts, NULL) < 0 && errno != EINTR) {
            perror("ppoll");
            return 1;
        }
        if (fds[0].revents & POLLIN)
            lane_take(&out, delay_ns);
        if (fds[1].revents & POLLIN)
            lane_take(&back, delay_ns);
    }
    fprintf(stderr,
            "{\"forwarded_out\": %llu, \"forwarded_back\": %llu, \"dropped\": %llu, "
            "\"write_errors\": %llu}\n",
            (unsigned long long)out.forwarded, (unsigned long long)back.forwarded,
            (unsigned long long)(out.dropped + back.dropped),
            (unsigned long long)(out.write_errors + back.write_errors));
    return 0;
}
