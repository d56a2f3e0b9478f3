/* mount(2) with the arguments given on the command line, as busybox's mount cannot pass them (the
 * old magic number in the flags): `mount_probe SOURCE TARGET TYPE FLAGS [DATA]`, FLAGS in hex.
 * Prints the errno (0: mounted). Built static so it runs in a bare rootfs. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mount.h>

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s SOURCE TARGET TYPE FLAGS [DATA]\n", argv[0]);
        return 2;
    }
    errno = 0;
    int r = mount(argv[1], argv[2], argv[3], strtoul(argv[4], NULL, 16), argc > 5 ? argv[5] : NULL);
    printf("%d\n", r == 0 ? 0 : errno);
    return 0;
}
