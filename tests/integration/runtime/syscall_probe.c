/* Tries syscalls a container escape needs; prints NAME=ok or NAME=errno:N per probe,
 * each in a child of its own (one that succeeds, like unshare, changes nothing after it).
 * Refuses to run anywhere but as pid 1 of a container with GPUCLOUD_PROBE_IN_CONTAINER set.
 * Built static by test_container_security.py and copied into the pod's rootfs. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/if_ether.h>
#include <netinet/in.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

static void report(const char *name, long rc) {
    if (rc < 0) printf("%s=errno:%d\n", name, errno);
    else printf("%s=ok\n", name);
}

static long sock(int domain, int type, int proto) {
    int fd = socket(domain, type, proto);
    if (fd >= 0) close(fd);
    return fd;
}

static long p_unshare_user(void) { return unshare(CLONE_NEWUSER); }
static long p_unshare_mount(void) { return unshare(CLONE_NEWNS); }
static long p_mount(void) { return mount("none", "/tmp", "tmpfs", 0, NULL); }
static long p_keyctl(void) { return syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3 /* session */, 0); }
static long p_add_key(void) { return syscall(SYS_add_key, "user", "x", "y", 1, -3); }
static long p_init_module(void) { return syscall(SYS_init_module, NULL, 0, ""); }
static long p_finit_module(void) { return syscall(SYS_finit_module, -1, "", 0); }
static long p_bpf(void) { return syscall(SYS_bpf, 0, NULL, 0); }
static long p_setns(void) { return syscall(SYS_setns, -1, 0); }
static long p_clone3(void) { return syscall(SYS_clone3, NULL, 0); }
static long p_sethostname(void) { return sethostname("x", 1); }
static long p_reboot(void) { return syscall(SYS_reboot, 0, 0, 0, NULL); }
static long p_raw_socket(void) { return sock(AF_INET, SOCK_RAW, IPPROTO_ICMP); }
static long p_packet_socket(void) { return sock(AF_PACKET, SOCK_RAW, htons(ETH_P_ALL)); }
static long p_vsock_socket(void) { return sock(AF_VSOCK, SOCK_STREAM, 0); }
static long p_tcp_socket(void) { return sock(AF_INET, SOCK_STREAM, 0); }
static long p_chroot(void) { return chroot("/"); }
static long p_personality(void) { return personality(0xffffffff); }

static long p_write_proc_sys(void) {
    int fd = open("/proc/sys/kernel/hostname", O_WRONLY);
    if (fd >= 0) close(fd);
    return fd;
}

struct probe { const char *name; long (*run)(void); };
static const struct probe probes[] = {
    {"unshare_user", p_unshare_user},
    {"unshare_mount", p_unshare_mount},
    {"mount", p_mount},
    {"keyctl", p_keyctl},
    {"add_key", p_add_key},
    {"init_module", p_init_module},
    {"finit_module", p_finit_module},
    {"bpf", p_bpf},
    {"setns", p_setns},
    {"clone3", p_clone3},
    {"sethostname", p_sethostname},
    {"reboot", p_reboot},
    {"raw_socket", p_raw_socket},
    {"packet_socket", p_packet_socket},
    {"vsock_socket", p_vsock_socket},
    {"tcp_socket", p_tcp_socket},
    {"chroot", p_chroot},
    {"personality", p_personality},
    {"write_proc_sys", p_write_proc_sys},
};

int main(void) {
    /* Each probe that succeeds changes the machine it runs on (sethostname, mount):
     * only ever inside the container the test starts. */
    if (getenv("GPUCLOUD_PROBE_IN_CONTAINER") == NULL || getpid() != 1) {
        fprintf(stderr, "syscall_probe: runs only as pid 1 of a test container\n");
        return 2;
    }
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
        fflush(stdout);
        pid_t child = fork();
        if (child == 0) {
            report(probes[i].name, probes[i].run());
            fflush(stdout);
            _exit(0);
        }
        waitpid(child, NULL, 0);
    }
    return 0;
}
